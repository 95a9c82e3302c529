"""A Mixture-of-Experts model's load-balancing loss when its batch runs on another layout than the padded one.

transformers computes the loss inside the causal LM's forward from the router logits and the 2D attention mask:
over a layout with a 4D mask (each pair's prompt once) or packed rows it would count the layout's filler tokens
and each shared prompt once, and a 4D mask does not even fit its 2D shape. So the layouts used to be refused for
MoE models whose loss was wanted, and a DPO, KTO or SFT step of one ran on the padded batch.

Instead, the router logits are recorded on the layout as transformers' own output capture records them (the
modules its `_can_record_outputs["router_logits"]` names, their output at its index), and the model's own loss
function (`load_balancing_loss_func` of its modeling file) gets, as its "attention mask", how many tokens of the
padded batch each position of the layout stands for: 1 for a token of one sequence, 2 for a prompt token a pair
shares, 0 for filler. Its sums are weighted by that mask, so the loss is the padded batch's, to float rounding.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import torch

from posttrain.models.reference import unwrap


def _base(model):
    inner = unwrap(model)
    return inner.get_base_model() if hasattr(inner, "get_base_model") else inner  # PEFT


def _router_spec(model) -> tuple[type, int] | None:
    """(router module class, index of the router logits in its output) as transformers records them, or None."""
    recorder = (getattr(type(_base(model)), "_can_record_outputs", None) or {}).get("router_logits")
    target = getattr(recorder, "target_class", recorder)
    if not isinstance(target, type) or getattr(recorder, "layer_name", None) or getattr(recorder, "class_name", None):
        return None
    return target, getattr(recorder, "index", 0)


def balancing_loss_function(model):
    """(the model's load-balancing loss function, experts, experts per token), or None."""
    base = _base(model)
    function = inspect.unwrap(type(base).forward).__globals__.get("load_balancing_loss_func")
    experts, top_k = getattr(base, "num_experts", None), getattr(base, "num_experts_per_tok", None)
    return None if function is None or experts is None or top_k is None else (function, experts, top_k)


def balancing_loss_on_layouts(model) -> bool:
    """Whether `recorded_balancing_loss` can compute `model`'s load-balancing loss on another layout."""
    return _router_spec(model) is not None and balancing_loss_function(model) is not None


def with_balancing_loss(model, forward: Callable[[], Any], weights: torch.Tensor) -> tuple[Any, torch.Tensor]:
    """(`forward()`, the model's load-balancing loss over that forward's router logits), each position of the
    layout weighted by `weights` (the layout's [rows, width]: the padded-batch tokens it stands for). `forward`
    runs the model on the layout with `output_router_logits=False`."""
    router_class, index = _router_spec(model)
    function, experts, top_k = balancing_loss_function(model)
    recorded = []

    def record(module, args, output):
        recorded.append(output[index] if isinstance(output, tuple) else output)

    handles = [m.register_forward_hook(record) for m in _base(model).modules() if isinstance(m, router_class)]
    try:
        result = forward()
    finally:
        for handle in handles:
            handle.remove()
    return result, function(tuple(recorded[: len(handles)]), experts, top_k, weights)
