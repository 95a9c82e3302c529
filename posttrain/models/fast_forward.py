"""Decoder forwards without transformers' per-module machinery, for the forwards that need no gradient.

A forward of a small model is mostly Python: `nn.Module.__call__` around every linear layer, norm and attention,
transformers' output-capturing and keyword-merging wrappers, attribute lookups through `nn.Module.__getattr__`.
On the tiny benchmark model (2 layers, hidden size 32) that is about a third of the 3 ms a decode step takes.
`fast_forward` runs what the model's own forward runs: transformers' own mask functions (a ready-made 4D mask
passes through them unchanged), the same tensor operations in the same order on the same tensors (the linear layers
as `F.linear` with their weights; norms, embeddings, activations, rotary embeddings and anything else a module
computes by calling that module's own forward, Gemma's norm with its (1 + weight) computed once; the attention
function and the rotary function the attention's forward looks up; the cache's own `update`), so logits and cache
are bitwise those of `model(...)`.

Which model it serves is decided by what the model computes, not by its class: each part (the causal LM head,
the decoder, each layer, its attention and MLP) must compute one of the kinds in `computes.KINDS`, recognised by its
forward's code: Llama, Qwen2, Qwen3 (q/k norms), Mistral (sliding window), Gemma 3 (sliding and full layers with
their own rotary embeddings, sandwich norms, scaled embeddings, soft-capped logits), Phi-3 (fused projections),
Qwen3-MoE and Mixtral (their expert blocks run as they are), and families that copy one of these. It also needs
plain `nn.Linear` projections and output layer, SDPA attention, no gradient, and no hooks anywhere (accelerate
offloading, FSDP, DeepSpeed ZeRO-3 and test spies all work through hooks); anything else (PEFT, quantized layers,
other families) gets None and calls the model. The decode loop uses it for its prefill and its steps, the online
trainers for their old and reference log-probs.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.modules import module as torch_module

from posttrain.models.computes import kind_of
from posttrain.models.fused_layers import FUSED_FORWARDS
from posttrain.runtime.paths import fast_path_on


def _inert(hook) -> bool:
    """transformers' output-capturing hook, which records nothing outside a forward that asks for hidden states or
    attentions (it is installed for good by the first such forward)."""
    return getattr(hook, "__module__", None) == "transformers.utils.output_capturing"


def _hooked(module: nn.Module) -> bool:
    return bool(
        module._forward_pre_hooks
        or hasattr(module, "_hf_hook")
        or not all(_inert(hook) for hook in module._forward_hooks.values())
    )


def _plain_linear(layer) -> bool:
    return type(layer) is nn.Linear and not _hooked(layer)


def _own_forward(module: nn.Module) -> bool:
    """No instance forward other than fused_layers' (which runs the class's forward when no gradient is wanted)."""
    forward = vars(module).get("forward")
    return forward is None or getattr(forward, "__func__", None) in FUSED_FORWARDS


def _direct(module) -> Callable:
    """What calling `module` computes, without `nn.Module.__call__` (the module has no hooks: checked before)."""
    return functools.partial(type(module).forward, module) if isinstance(module, nn.Module) else module


def _norm(norm) -> Callable:
    """What `norm` computes: Gemma's (1 + weight) RMSNorm with its (1 + weight) computed once for the forward's
    lifetime (the same float32 tensor it computes at every call), any other norm by its own forward."""
    if kind_of(norm, "norm") != "one_plus_weight_rms":
        return _direct(norm)
    scale, eps = 1.0 + norm.weight.float(), norm.eps

    def one_plus_weight_rms(x):
        states = x.float()
        states = states * torch.rsqrt(states.pow(2).mean(-1, keepdim=True) + eps)
        return (states * scale).type_as(x)

    return one_plus_weight_rms


def _linear(layer: nn.Linear) -> Callable:
    weight, bias = layer.weight, layer.bias
    return lambda x: F.linear(x, weight, bias)


def _parts(model) -> tuple[str, str, list[tuple[nn.Module, str, str]]] | None:
    """(head kind, decoder kind, [(layer, layer kind, attention kind)]) when every part is a known kind with plain
    projections and no hooks, and the forward would need no gradient; else None."""
    if torch.is_grad_enabled() or torch_module._has_any_global_hook() or not isinstance(model, nn.Module):
        return None
    inner = getattr(model, "model", None)
    if not isinstance(inner, nn.Module):
        return None
    head_kind, decoder_kind = kind_of(model, "causal_lm"), kind_of(inner, "decoder")
    config = getattr(inner, "config", None)
    if (
        head_kind is None
        or decoder_kind is None
        or config._attn_implementation != "sdpa"
        or getattr(config, "use_bidirectional_attention", False)
        or not _plain_linear(model.lm_head)
        or any(_hooked(m) or not _own_forward(m) for m in model.modules())
    ):
        return None
    layers = []
    for layer in inner.layers[: config.num_hidden_layers]:
        attention = layer.self_attn
        layer_kind, attention_kind = kind_of(layer, "layer"), kind_of(attention, "attention")
        projections = [m for name, m in attention.named_children() if name.endswith("proj")]
        if (
            layer_kind is None
            or attention_kind is None
            or attention.config._attn_implementation != "sdpa"
            or not all(_plain_linear(p) for p in projections)
        ):
            return None
        layers.append((layer, layer_kind, attention_kind))
    return head_kind, decoder_kind, layers


def _attention(attention, kind: str) -> Callable:
    """`attend(x, mask, cos, sin, cache)`: what `attention`'s forward computes, for each attention kind."""
    forward_globals = inspect.unwrap(type(attention).forward).__globals__
    rotate = forward_globals["apply_rotary_pos_emb"]  # looked up as the forward does (a patched one included)
    function = forward_globals["ALL_ATTENTION_FUNCTIONS"].get_interface(
        attention.config._attn_implementation, forward_globals["eager_attention_forward"]
    )
    head_dim, layer_idx, scaling = attention.head_dim, attention.layer_idx, attention.scaling
    dropout = attention.attention_dropout if attention.training else 0.0
    output = _linear(attention.o_proj)
    if kind == "fused_projection":
        qkv = _linear(attention.qkv_proj)
        query_width = attention.config.num_attention_heads * head_dim
        key_end = query_width + attention.num_key_value_heads * head_dim
    else:
        q_proj, k_proj, v_proj = (_linear(p) for p in (attention.q_proj, attention.k_proj, attention.v_proj))
    if kind in ("head_norms", "head_norms_transposed"):
        q_norm, k_norm = _norm(attention.q_norm), _norm(attention.k_norm)

    def attend(x, mask, cos, sin, cache):
        input_shape = x.shape[:-1]
        shape = (*input_shape, -1, head_dim)
        if kind == "fused_projection":
            states = qkv(x)
            query, key, value = states[..., :query_width], states[..., query_width:key_end], states[..., key_end:]
            query, key, value = (t.view(shape).transpose(1, 2) for t in (query, key, value))
        elif kind == "head_norms":
            query = q_norm(q_proj(x).view(shape)).transpose(1, 2)
            key = k_norm(k_proj(x).view(shape)).transpose(1, 2)
            value = v_proj(x).view(shape).transpose(1, 2)
        else:
            query, key, value = (p(x).view(shape).transpose(1, 2) for p in (q_proj, k_proj, v_proj))
            if kind == "head_norms_transposed":
                query, key = q_norm(query), k_norm(key)
        query, key = rotate(query, key, cos, sin)
        if cache is not None:
            key, value = cache.update(key, value, layer_idx)
        out, _ = function(attention, query, key, value, mask, dropout=dropout, scaling=scaling)
        return output(out.reshape(*input_shape, -1).contiguous())

    return attend


def _mlp(mlp) -> Callable:
    """What `mlp` computes: the gated MLP kinds as functional calls, any other (an expert block) by its forward."""
    kind = kind_of(mlp, "mlp")
    if kind == "gated" and all(_plain_linear(p) for p in (mlp.gate_proj, mlp.up_proj, mlp.down_proj)):
        gate, up, down, act = _linear(mlp.gate_proj), _linear(mlp.up_proj), _linear(mlp.down_proj), _direct(mlp.act_fn)
        return lambda x: down(act(gate(x)) * up(x))
    if kind == "fused_gated" and _plain_linear(mlp.gate_up_proj) and _plain_linear(mlp.down_proj):
        gate_up, down, act = _linear(mlp.gate_up_proj), _linear(mlp.down_proj), _direct(mlp.activation_fn)

        def fused_gated(x):
            gate, up = gate_up(x).chunk(2, dim=-1)
            return down(up * act(gate))

        return fused_gated
    return _direct(mlp)


def _layer(layer, kind: str, attention_kind: str) -> Callable:
    """`step(states, mask, cos, sin, cache) -> states`: what `layer`'s forward computes, for each layer kind."""
    attend, mlp = _attention(layer.self_attn, attention_kind), _mlp(layer.mlp)
    norm_in, norm_post = _norm(layer.input_layernorm), _norm(layer.post_attention_layernorm)
    if kind == "sandwich_norm":
        pre_mlp, post_mlp = _norm(layer.pre_feedforward_layernorm), _norm(layer.post_feedforward_layernorm)

        def step(states, mask, cos, sin, cache):
            states = states + norm_post(attend(norm_in(states), mask, cos, sin, cache))
            return states + post_mlp(mlp(pre_mlp(states)))

    elif kind == "pre_norm_dropout":
        drop_attention, drop_mlp = _direct(layer.resid_attn_dropout), _direct(layer.resid_mlp_dropout)

        def step(states, mask, cos, sin, cache):
            states = states + drop_attention(attend(norm_in(states), mask, cos, sin, cache))
            return states + drop_mlp(mlp(norm_post(states)))

    else:

        def step(states, mask, cos, sin, cache):
            states = states + attend(norm_in(states), mask, cos, sin, cache)
            return states + mlp(norm_post(states))

    return step


def _masks_and_rotary(inner, kind: str) -> Callable:
    """`prepare(states, attention_mask, cache, position_ids) -> ({layer type: mask}, {layer type: (cos, sin)})`
    as the decoder's forward builds them; layers of one type share both (a decoder without types: type None)."""
    forward_globals = inspect.unwrap(type(inner).forward).__globals__
    causal, sliding = forward_globals["create_causal_mask"], forward_globals.get("create_sliding_window_causal_mask")
    config, rotary = inner.config, _direct(inner.rotary_emb)
    types = set(config.layer_types) if kind in ("mask_per_layer_type", "mask_and_rotary_per_layer_type") else {None}
    builders = {layer_type: causal for layer_type in types}
    if kind == "window_mask" and config.sliding_window is not None:
        builders[None] = sliding
    if kind == "mask_and_rotary_per_layer_type" or (kind == "mask_per_layer_type" and inner.has_sliding_layers):
        builders["sliding_attention"] = sliding
    per_type_rotary = kind == "mask_and_rotary_per_layer_type"

    def prepare(states, attention_mask, cache, position_ids):
        arguments = dict(
            config=config, inputs_embeds=states, attention_mask=attention_mask, cache=cache, position_ids=position_ids
        )
        if isinstance(attention_mask, dict):  # ready-made per layer type (as these decoders take them)
            masks = attention_mask
        else:
            masks = {layer_type: build(**arguments) for layer_type, build in builders.items()}
        if per_type_rotary:
            return masks, {layer_type: rotary(states, position_ids, layer_type) for layer_type in types}
        return masks, dict.fromkeys(types, rotary(states, position_ids))

    return prepare


def _measured_here(model) -> bool:
    """Whether the fast forward runs on the device of `model`'s weights (runtime/measured.py, or turned on)."""
    weight = next(model.parameters(), None)
    return fast_path_on("fast_forward", "cpu" if weight is None else weight.device.type)


def fast_forward(model) -> Callable | None:
    """`forward(input_ids, attention_mask, position_ids, cache=None, logits_to_keep=0) -> logits`, equal to
    `model(input_ids=..., attention_mask=..., position_ids=..., cache=cache, use_cache=cache is not None,
    logits_to_keep=...).logits` (`attention_mask` 2D, or 4D ready for SDPA, or such masks by layer type where the
    decoder takes them, `layouts.windowed_masks`); with `hidden=True` the final
    hidden states the output layer would read instead of the logits. None when `model` is not one this
    module reproduces exactly (see the module docstring). The weights are looked up once: build a forward per use,
    not across optimizer steps that could replace parameters."""
    if not _measured_here(model):
        return None
    parts = _parts(model)
    if parts is None:
        return None
    try:
        from transformers.modeling_utils import slice_logits_to_keep
    except ImportError:  # transformers before 5.20 (the vLLM environment's): the model's own forward
        return None

    head_kind, decoder_kind, layers = parts
    inner = model.model
    layer_types = (
        inner.config.layer_types
        if decoder_kind in ("mask_per_layer_type", "mask_and_rotary_per_layer_type")
        else [None] * len(layers)
    )
    steps = [(_layer(*layer), layer_type) for layer, layer_type in zip(layers, layer_types)]
    embed, final_norm, head = _direct(inner.embed_tokens), _norm(inner.norm), _linear(model.lm_head)
    prepare = _masks_and_rotary(inner, decoder_kind)
    cap = model.config.final_logit_softcapping if head_kind == "soft_capped_head" else None

    def forward(
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        position_ids: torch.Tensor,
        cache=None,
        logits_to_keep: int = 0,
        hidden: bool = False,
    ) -> torch.Tensor:
        states = embed(input_ids)
        masks, rotary = prepare(states, attention_mask, cache, position_ids)
        for step, layer_type in steps:
            states = step(states, masks[layer_type], *rotary[layer_type], cache)
        states = slice_logits_to_keep(final_norm(states), logits_to_keep)
        if hidden:
            return states
        logits = head(states)
        if cap is not None:
            logits = logits / cap
            logits = torch.tanh(logits)
            logits = logits * cap
        return logits

    return forward


def fast_forward_name(model) -> str | None:
    """A short description of the fast forward `model` would get on a device where it runs (its decoder's and
    layers' kinds), or None."""
    with torch.no_grad():
        parts = _parts(model)
    if parts is None:
        return None
    _, decoder_kind, layers = parts
    kinds = sorted({f"{layer}/{attention}" for _, layer, attention in layers})
    return f"{decoder_kind}, {', '.join(kinds)}"
