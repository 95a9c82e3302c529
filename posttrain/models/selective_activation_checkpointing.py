"""Selective activation checkpointing at TRL's `trl.models.selective_activation_checkpointing` path: each decoder
layer recomputes its cheap operations (norms, activations, element-wise ops) in the backward pass and keeps the
outputs of its matrix products and attention, which cost the most to recompute."""

from __future__ import annotations

import functools

import torch
from torch import nn

_SAVED_OPS = (
    "mm",
    "addmm",
    "bmm",
    "baddbmm",
    "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_cudnn_attention",
    "_scaled_dot_product_flash_attention_for_cpu",
)


def _policy(ctx, op, *args, **kwargs):
    from torch.utils.checkpoint import CheckpointPolicy

    name = getattr(op, "__name__", "").split(".")[0]
    return CheckpointPolicy.MUST_SAVE if name in _SAVED_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def enable_selective_activation_checkpointing(model: nn.Module) -> None:
    """Wraps the forward of every decoder layer of `model` (the classes in its `_no_split_modules`) in torch's
    checkpoint with a selective policy: matrix-product and attention outputs saved, the rest recomputed. Gradients
    are those of the plain model; the forward's memory is what the saved products need. The model's KV cache is
    switched off (`use_cache=False`), as for any activation checkpointing."""
    from torch.utils.checkpoint import checkpoint, create_selective_checkpoint_contexts

    layer_names = set(getattr(model, "_no_split_modules", None) or ())
    layers = [m for m in model.modules() if type(m).__name__ in layer_names]
    if not layers:
        raise ValueError(
            f"{type(model).__name__} names no decoder layer class (_no_split_modules): selective activation "
            "checkpointing wraps decoder layers. Use gradient_checkpointing=True for this model instead."
        )
    if getattr(model, "config", None) is not None:
        model.config.use_cache = False  # a KV cache filled in the forward would differ in the recomputation
    context = functools.partial(create_selective_checkpoint_contexts, _policy)
    for layer in layers:
        forward = layer.forward

        @functools.wraps(forward)
        def checkpointed(*args, _forward=forward, **kwargs):
            if not torch.is_grad_enabled():
                return _forward(*args, **kwargs)
            return checkpoint(_forward, *args, use_reentrant=False, context_fn=context, **kwargs)

        layer.forward = checkpointed


__all__ = ["enable_selective_activation_checkpointing"]
