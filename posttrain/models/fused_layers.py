"""RMSNorm and gated MLPs (SwiGLU, GeGLU) as single autograd functions that keep fewer activations.

Left to autograd, `down(silu(gate(x)) * up(x))` keeps four [tokens x intermediate] tensors for the backward pass
(gate(x), silu of it, up(x), their product) and each RMSNorm keeps two [tokens x hidden] ones; at 1,024 tokens that
is about 500 MB of SmolLM2-135M's 1.3 GB of activations. These functions keep only what the backward cannot cheaply
rebuild (gate(x) and up(x); the norm's input and inverse RMS) and redo the elementwise rest. The matmuls are the
same, so speed stays within a few percent (a SmolLM2-shaped MLP 1.015x the time, its norm 0.77x), and values and
gradients equal the modules' own to rounding.

`fuse_layers(model)` rebinds `forward` on each module that computes one of these formulas, whatever its class:
a norm whose forward is Llama's RMSNorm or Gemma's (1 + weight) RMSNorm (which multiplies by 1 + weight in float32
before casting back, where Llama casts first) and an MLP whose forward is Llama's or Phi-3's gated MLP (recognised
by their code, `computes.py`: Qwen2, Qwen3, Mistral, Phi-3, Qwen3-MoE, Mixtral and Gemma 3's MLP among them) with
an activation that computes SiLU or tanh-GELU bit for bit on probe values. A module whose formula is none of these
is left alone. At call time the fused path is taken only when a gradient is wanted and the
projections are plain bias-free `nn.Linear` layers with their weights present: a LoRA-wrapped, quantized or
DeepSpeed ZeRO-3-partitioned projection runs the module's own forward.

Inside `rebuilt_activations()` a norm's output is not kept by the layers that read it (the q/k/v projections,
the MLP): autograd's saved-tensor hooks replace it with a recipe (the norm's own saved input and inverse RMS) and
rebuild it, bit for bit, when the backward pass needs it. That is two [tokens x hidden] tensors fewer per layer
(97 MB of SmolLM2-135M's activations at 706 tokens) for four elementwise passes per layer in the backward. An MLP
whose projections are not plain (LoRA, quantized) runs Llama's own operations there, and keeps gate(x) and up(x)
but not silu(gate(x)) nor the product, which are rebuilt the same way (two [tokens x intermediate] tensors per
layer; 260 MB of SmolLM2-135M's LoRA activations at 706 tokens).
"""

from __future__ import annotations

import contextlib
import functools
import types
import weakref

import torch
import torch.nn.functional as F
from torch import nn

from posttrain.models.computes import kind_of


def _autocast_state(device_type: str) -> tuple[str, bool, torch.dtype]:
    return device_type, torch.is_autocast_enabled(device_type), torch.get_autocast_dtype(device_type)


# The activations a gated MLP may have (its forward, its backward from the gradient and its input).
ACTIVATIONS = {
    "silu": (F.silu, torch.ops.aten.silu_backward),
    "gelu_tanh": (
        functools.partial(F.gelu, approximate="tanh"),
        functools.partial(torch.ops.aten.gelu_backward, approximate="tanh"),
    ),
}


class _GatedMLP(torch.autograd.Function):
    """down(act(x W_gate^T) * x W_up^T) W_down^T, keeping x, gate and up (act: a key of ACTIVATIONS)."""

    @staticmethod
    def forward(ctx, x, w_gate, w_up, w_down, activation):
        gate, up = F.linear(x, w_gate), F.linear(x, w_up)
        ctx.save_for_backward(x, w_gate, w_up, w_down, gate, up)
        ctx.autocast = _autocast_state(x.device.type)  # the backward's matmuls run as the forward's did
        ctx.activation = activation
        return F.linear(ACTIVATIONS[activation][0](gate) * up, w_down)

    @staticmethod
    def backward(ctx, grad):
        x, w_gate, w_up, w_down, gate, up = ctx.saved_tensors
        act, act_backward = ACTIVATIONS[ctx.activation]
        device_type, enabled, dtype = ctx.autocast
        with torch.autocast(device_type, dtype=dtype, enabled=enabled):
            activated = act(gate)
            d_hidden = grad @ w_down
            d_up = d_hidden * activated
            d_gate = act_backward(d_hidden.mul_(up), gate)
            flat = lambda t: t.reshape(-1, t.shape[-1])  # noqa: E731
            d_x = None
            if ctx.needs_input_grad[0]:
                d_x = torch.addmm(flat(d_up) @ w_up, flat(d_gate), w_gate).view_as(x)
            d_w_gate = flat(d_gate).T @ flat(x) if ctx.needs_input_grad[1] else None
            d_w_up = flat(d_up).T @ flat(x) if ctx.needs_input_grad[2] else None
            d_w_down = flat(grad).T @ flat(activated.mul_(up)) if ctx.needs_input_grad[3] else None
        return d_x, d_w_gate, d_w_up, d_w_down, None


def activation_name(activation) -> str | None:
    """The key of ACTIVATIONS that `activation` (a module without parameters or children) computes, found by
    comparing its outputs with each candidate's, bit for bit, on values from -10 to 10 in three precisions."""
    if not isinstance(activation, nn.Module) or any(True for _ in activation.children()):
        return None
    if any(True for _ in activation.parameters()) or "forward" in vars(activation):
        return None
    probes = [torch.linspace(-10, 10, 2001, dtype=dtype) for dtype in (torch.float32, torch.float64, torch.bfloat16)]
    with torch.no_grad():
        for name, (function, _) in ACTIVATIONS.items():
            if all(torch.equal(activation(probe), function(probe)) for probe in probes):
                return name
    return None


class _RMSNorm(torch.autograd.Function):
    """weight * (x / rms(x)) computed in float32 and cast back as Llama's RMSNorm does, keeping x and 1 / rms."""

    @staticmethod
    def forward(ctx, x, weight, eps):
        x32 = x.float()
        inv_rms = torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
        ctx.save_for_backward(x, weight, inv_rms)
        return _remember(_normalized(x32, weight, inv_rms, x.dtype), _normalized_from, x, weight, inv_rms)

    @staticmethod
    def backward(ctx, grad):
        x, weight, inv_rms = ctx.saved_tensors
        normed = x.float() * inv_rms
        d_weight = None
        if ctx.needs_input_grad[1]:
            d_weight = (grad * normed.to(x.dtype)).reshape(-1, weight.shape[-1]).sum(0)
        d_x = None
        if ctx.needs_input_grad[0]:
            d_normed = (grad * weight).float()
            dot = (d_normed * normed).mean(-1, keepdim=True)
            d_x = torch.addcmul(d_normed, normed, dot, value=-1).mul_(inv_rms).to(x.dtype)
        return d_x, d_weight, None


def _normalized(x32, weight, inv_rms, dtype):
    return weight * (x32 * inv_rms).to(dtype)


def _normalized_from(x, weight, inv_rms):
    return _normalized(x.float(), weight, inv_rms, x.dtype)


class _OnePlusWeightRMSNorm(torch.autograd.Function):
    """(x / rms(x)) * (1 + weight), all in float32 and cast back only then, as Gemma's RMSNorm computes it; keeps x
    and 1 / rms."""

    @staticmethod
    def forward(ctx, x, weight, eps):
        x32 = x.float()
        inv_rms = torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
        ctx.save_for_backward(x, weight, inv_rms)
        output = _one_plus_normalized(x32, weight, inv_rms, x.dtype)
        return _remember(output, _one_plus_normalized_from, x, weight, inv_rms)

    @staticmethod
    def backward(ctx, grad):
        x, weight, inv_rms = ctx.saved_tensors
        normed, grad32 = x.float() * inv_rms, grad.float()
        d_weight = None
        if ctx.needs_input_grad[1]:
            d_weight = (grad32 * normed).reshape(-1, weight.shape[-1]).sum(0).to(weight.dtype)
        d_x = None
        if ctx.needs_input_grad[0]:
            d_normed = grad32 * (1.0 + weight.float())
            dot = (d_normed * normed).mean(-1, keepdim=True)
            d_x = torch.addcmul(d_normed, normed, dot, value=-1).mul_(inv_rms).to(x.dtype)
        return d_x, d_weight, None


def _one_plus_normalized(x32, weight, inv_rms, dtype):
    return (x32 * inv_rms * (1.0 + weight.float())).to(dtype)


def _one_plus_normalized_from(x, weight, inv_rms):
    return _one_plus_normalized(x.float(), weight, inv_rms, x.dtype)


class _Recipe:
    """An output as the function and inputs that make it (inputs the backward keeps anyway); rebuilt once, shared
    by every layer that saved it or a view of it, and freed with the last of them."""

    def __init__(self, make, *inputs):
        self.make, self.inputs, self.value = make, inputs, None
        self.versions = [t._version for t in inputs]

    def rebuild(self) -> torch.Tensor:
        if self.value is None:
            if [t._version for t in self.inputs] != self.versions:
                raise RuntimeError(
                    "A tensor an activation is rebuilt from was modified in place after the forward "
                    "pass; run without fused_layers to modify it."
                )
            with torch.no_grad():
                self.value = self.make(*self.inputs)
        return self.value


# Storage address -> weak reference to an output made inside `rebuilt_activations`, which carries its recipe.
_rebuildable: dict | None = None


def _remember(output: torch.Tensor, make, *inputs) -> torch.Tensor:
    """Marks `output` (= make(*inputs)) as rebuildable for the layers that save it, inside `rebuilt_activations`.
    The recipe lives on the output, so an output nobody saves (gradient checkpointing frees a layer's) does not keep
    the recipe's inputs alive."""
    if _rebuildable is not None:
        output._recipe = _Recipe(make, *inputs)
        _rebuildable[output.untyped_storage().data_ptr()] = weakref.ref(output)
    return output


def _pack(tensor):
    """A saved tensor that is (a view of) a live, unmodified rebuildable output becomes its recipe and view
    geometry. Layers often save a reshaped view (a linear layer flattens its input), hence the match by storage:
    while the output is alive its storage cannot belong to another tensor."""
    if not _rebuildable or tensor.layout is not torch.strided:
        return tensor
    try:
        entry = _rebuildable.get(tensor.untyped_storage().data_ptr())
    except (RuntimeError, NotImplementedError):  # a tensor without storage of its own (a wrapper subclass)
        return tensor
    output = entry() if entry is not None else None
    if output is None or output._version or tensor._version:  # changed in place: keep the tensor itself
        return tensor
    return output._recipe, tensor.shape, tensor.stride(), tensor.storage_offset()


def _unpack(packed):
    if isinstance(packed, tuple):
        recipe, shape, stride, offset = packed
        return recipe.rebuild().as_strided(shape, stride, offset)
    return packed


@contextlib.contextmanager
def rebuilt_activations(enabled: bool = True):
    """Within the block (a forward pass), fused norms' outputs and the elementwise outputs of MLPs that run their
    own projections are saved for the backward as recipes. Not for sharded weights (FSDP, ZeRO-3: the norm weight
    is gone after the forward) nor inside other saved-tensor hooks (activation offloading), which the caller rules
    out."""
    global _rebuildable
    if not enabled or _rebuildable is not None:
        yield
        return
    _rebuildable = {}
    try:
        with torch.autograd.graph.saved_tensors_hooks(_pack, _unpack):
            yield
    finally:
        _rebuildable = None


def _wants_grad(*tensors: torch.Tensor) -> bool:
    return torch.is_grad_enabled() and any(t.requires_grad for t in tensors)


def _plain_weight(layer: nn.Module) -> bool:
    """A bias-free nn.Linear (not a subclass: quantized layers are) whose weight is really here (not ZeRO-3's)."""
    return type(layer) is nn.Linear and layer.bias is None and not hasattr(layer.weight, "ds_id")


def _fused_mlp_forward(self, x):
    layers = (self.gate_proj, self.up_proj, self.down_proj)
    if all(_plain_weight(layer) for layer in layers) and _wants_grad(x, *(layer.weight for layer in layers)):
        weights = (layer.weight for layer in layers)
        return _GatedMLP.apply(x, *weights, self._posttrain_activation)
    if _rebuildable is None or not torch.is_grad_enabled():
        return type(self).forward(self, x)
    # Projections of their own (LoRA, quantized): Llama's forward, operation for operation, whose act(gate) and
    # act(gate) * up are rebuilt from gate and up (which the backward keeps) instead of kept.
    gate = self.gate_proj(x)
    activated = _remember(self.act_fn(gate), self.act_fn, gate)
    up = self.up_proj(x)
    return self.down_proj(_remember(activated * up, _gated, self.act_fn, gate, up))


def _fused_gate_up_forward(self, x):
    """An MLP with one gate-and-up projection (Phi-3's): the gated MLP on the two halves of its weight."""
    layers = (self.gate_up_proj, self.down_proj)
    if all(_plain_weight(layer) for layer in layers) and _wants_grad(x, *(layer.weight for layer in layers)):
        gate, up = self.gate_up_proj.weight.chunk(2, dim=0)
        return _GatedMLP.apply(x, gate, up, self.down_proj.weight, self._posttrain_activation)
    return type(self).forward(self, x)


def _gated(act_fn, gate, up):
    return act_fn(gate) * up


def _fused_norm_forward(self, hidden_states):
    if _wants_grad(hidden_states, self.weight):
        return _RMSNorm.apply(hidden_states, self.weight, self.variance_epsilon)
    return type(self).forward(self, hidden_states)


def _fused_one_plus_norm_forward(self, x):
    if _wants_grad(x, self.weight):
        return _OnePlusWeightRMSNorm.apply(x, self.weight, self.eps)
    return type(self).forward(self, x)


# The forwards `fuse_layers` binds: each runs the module's own forward when no gradient is wanted.
FUSED_FORWARDS = (_fused_norm_forward, _fused_one_plus_norm_forward, _fused_mlp_forward, _fused_gate_up_forward)


def _fused_forward(module: nn.Module):
    """The fused forward for what `module` computes (`computes.KINDS`: Llama's or Gemma's RMSNorm, a gated MLP with
    a SiLU or tanh-GELU activation, separate or one gate-and-up projection), or None."""
    norm = kind_of(module, "norm")
    if norm == "rms":
        return _fused_norm_forward
    if norm == "one_plus_weight_rms":
        return _fused_one_plus_norm_forward
    mlp = kind_of(module, "mlp")
    if mlp == "gated" and activation_name(module.act_fn) is not None:
        module._posttrain_activation = activation_name(module.act_fn)
        return _fused_mlp_forward
    if mlp == "fused_gated" and activation_name(module.activation_fn) is not None:
        module._posttrain_activation = activation_name(module.activation_fn)
        return _fused_gate_up_forward
    return None


def is_fused_forward(forward) -> bool:
    """Whether `forward` (a module's instance attribute) is one that `fuse_layers` bound."""
    return getattr(forward, "__func__", None) in FUSED_FORWARDS


def fuse_layers(model: nn.Module) -> int:
    """Rebinds the forward of every RMSNorm and gated MLP in `model` that computes a formula fused here; returns
    how many."""
    count = 0
    for module in model.modules():
        if "forward" in vars(module):  # already rebound (by this or by another library)
            continue
        forward = _fused_forward(module)
        if forward is not None:
            module.forward = types.MethodType(forward, module)
            count += 1
    return count


def unfuse_layers(model: nn.Module) -> int:
    """Undoes `fuse_layers` (a bound forward does not pickle: a copy sent to another process needs this); the
    plain forward computes the same numbers without gradients. Returns how many modules it restored."""
    count = 0
    for module in model.modules():
        if is_fused_forward(vars(module).get("forward")):
            del module.forward
            count += 1
    return count
