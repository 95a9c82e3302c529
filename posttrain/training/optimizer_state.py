"""Adam's moment buffers in one allocation per dtype and device.

torch's Adam creates a parameter's two moment buffers the first time the parameter has a gradient, two tensors per
parameter, in the middle of the first optimizer step. On a CPU those hundreds of long-lived tensors land in the holes
that the first step's activations left in the C allocator's heap; the next steps' activations no longer fit there
and the heap grows (SmolLM2-135M: +60 MB peak RSS in full fine-tuning, about +200 MB with LoRA, whose 800 small
buffers scatter across the holes). Created instead just before that first step as views of one buffer (large enough
to be a memory mapping of its own), they leave the heap to what comes and goes each step.

The buffers are what Adam would have created (zeros, the same dtypes, `step` as Adam makes it), so training is
bit for bit unchanged; a parameter whose first gradient comes later, or whose state a checkpoint brought, is left
to Adam.
"""

from __future__ import annotations

import torch

from posttrain.runtime.paths import fast_path_on

_ADAMS = (torch.optim.Adam, torch.optim.AdamW)


def allocate_adam_states_together(optimizer: torch.optim.Optimizer) -> bool:
    """Arranges for `optimizer` (exactly torch's Adam or AdamW; others are left alone) to get the moment buffers of
    the parameters that have a gradient at its first step from one allocation. Returns whether it will."""
    if type(optimizer) not in _ADAMS:
        return False
    first = next((p for group in optimizer.param_groups for p in group["params"]), None)
    if first is None or not fast_path_on("adam_layout", first.device.type):  # where measured (runtime/measured.py)
        return False
    done = False

    def before_first_step(opt, args, kwargs):
        nonlocal done
        if not done:
            done = True
            _allocate(opt)

    optimizer.register_step_pre_hook(before_first_step)
    return True


def _step_counter(group: dict, param: torch.Tensor) -> torch.Tensor:
    """The `step` tensor Adam's lazy initialisation makes for this group's options."""
    if group["fused"] or group["capturable"]:
        return torch.zeros((), dtype=torch.float32 if group["fused"] else _scalar_dtype(), device=param.device)
    return torch.tensor(0.0, dtype=_scalar_dtype(), device="cpu")


def _scalar_dtype() -> torch.dtype:
    return torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32


def _allocate(optimizer: torch.optim.Optimizer) -> None:
    wanted: dict[tuple[torch.dtype, torch.device], list[tuple[dict, torch.Tensor]]] = {}
    for group in optimizer.param_groups:
        if group.get("differentiable"):
            return  # its state tensors may join the autograd graph: Adam's own path only
        for param in group["params"]:
            plain = type(param.data) is torch.Tensor and param.is_contiguous() and param.is_floating_point()
            if group["fused"] and param.device.type not in ("cpu", "cuda"):
                plain = False  # Adam's own initialisation checks what its fused kernel supports
            if param.grad is None or optimizer.state.get(param) or not plain or param.grad.is_sparse:
                continue
            wanted.setdefault((param.dtype, param.device), []).append((group, param))
    for (dtype, device), entries in wanted.items():
        moments = [3 if group["amsgrad"] else 2 for group, _ in entries]
        buffer = torch.zeros(sum(n * p.numel() for n, (_, p) in zip(moments, entries)), dtype=dtype, device=device)
        offset = 0
        for n, (group, param) in zip(moments, entries):
            views = []
            for _ in range(n):
                views.append(buffer[offset : offset + param.numel()].view_as(param))
                offset += param.numel()
            state = {"step": _step_counter(group, param), "exp_avg": views[0], "exp_avg_sq": views[1]}
            if group["amsgrad"]:
                state["max_exp_avg_sq"] = views[2]
            optimizer.state[param] = state
