"""A tied input embedding that delivers the output layer's gradient with its own rows added, in place.

With tied weights (SmolLM2, Qwen, Llama 3.2 small) the embedding and the output layer share one [vocab x hidden]
parameter. The embedding's own backward returns a dense [vocab x hidden] gradient (zeros plus the looked-up rows),
which autograd then adds to the output layer's: at the end of every backward pass one more tensor of the whole
vocabulary is live (113 MB for SmolLM2-135M, the step's peak). Here the fused head loss hands its weight gradient
over (`on_weight_grad=`) instead of returning it; the lookup's backward, which runs later (the head depends on
it), adds the rows it used into that tensor and returns it as the parameter's gradient. Autograd sums it with any
other gradient of the parameter as usual. If no lookup ran in the forward, the head keeps its gradient; if the
lookup got none (the head's came from elsewhere), it returns the usual dense gradient.
"""

from __future__ import annotations

import contextlib
import types

import torch
import torch.nn.functional as F
from torch import nn


class HeadGradient:
    """The output layer's weight gradient on its way from the head loss's backward to the lookup's backward."""

    def __init__(self):
        self.armed = False  # a lookup of this forward will run a backward
        self.grad: torch.Tensor | None = None

    def __call__(self, grad: torch.Tensor) -> bool:
        """Takes the head's gradient over if a lookup is there to deliver it."""
        if not self.armed:
            return False
        self.grad = grad
        torch.autograd.Variable._execution_engine.queue_callback(self._check_delivered)
        return True

    def take(self) -> torch.Tensor | None:
        grad, self.grad = self.grad, None  # no reference kept: autograd may take the tensor over without a copy
        return grad

    def _check_delivered(self) -> None:
        if self.grad is not None:  # the lookup's output did not reach the loss: the head's gradient would be lost
            self.grad = None
            raise RuntimeError(
                "The tied output layer's gradient was handed to the input embedding, whose backward "
                "did not run (its output does not reach the loss). Set fused_layers=False."
            )


class _Lookup(torch.autograd.Function):
    @staticmethod
    def forward(ctx, ids, weight, padding_idx, handoff):
        ctx.save_for_backward(ids)
        ctx.padding_idx, ctx.rows, ctx.handoff = padding_idx, weight.shape[0], handoff
        handoff.armed = True
        return F.embedding(ids, weight, padding_idx)

    @staticmethod
    def backward(ctx, grad):
        (ids,) = ctx.saved_tensors
        target = ctx.handoff.take()
        if target is None:
            padding = -1 if ctx.padding_idx is None else ctx.padding_idx
            return None, torch.ops.aten.embedding_dense_backward(grad, ids, ctx.rows, padding, False), None, None
        ids, grad = ids.flatten(), grad.reshape(-1, grad.shape[-1])
        if ctx.padding_idx is not None:  # as the dense backward: the padding row gets no gradient
            keep = ids != ctx.padding_idx
            ids, grad = ids[keep], grad[keep]
        return None, target.index_add_(0, ids, grad.to(target.dtype)), None, None


def _lookup_forward(self, input_ids):
    if torch.is_grad_enabled() and self.weight.requires_grad:
        return _Lookup.apply(input_ids, self.weight, self.padding_idx, self._posttrain_head_gradient)
    return type(self).forward(self, input_ids)


def _input_embedding(model):
    return model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None


def allow_tied_embedding(model) -> None:
    """Lets `tied_embedding` apply to `model` (trainers do so with fused_layers=True)."""
    embedding = _input_embedding(model)
    if isinstance(embedding, nn.Module):
        embedding._posttrain_tied_gradient = True


def tied_embedding(model, head_weight: torch.Tensor | None):
    """A context for one forward in which `model`'s input embedding, if allowed (`allow_tied_embedding`) and a plain
    `nn.Embedding` tied to `head_weight`, delivers the head's gradient; yields the `HeadGradient` to pass to the head
    loss as `on_weight_grad` (None where it does not apply)."""
    embedding = _input_embedding(model)
    applies = (
        type(embedding) is nn.Embedding
        and getattr(embedding, "_posttrain_tied_gradient", False)
        and head_weight is not None
        and embedding.weight is head_weight
        and embedding.max_norm is None
        and not embedding.scale_grad_by_freq
        and not embedding.sparse
        and "forward" not in vars(embedding)
    )
    if not applies:
        return contextlib.nullcontext()
    return _swapped_forward(embedding)


@contextlib.contextmanager
def _swapped_forward(embedding: nn.Embedding):
    handoff = HeadGradient()
    embedding._posttrain_head_gradient = handoff
    embedding.forward = types.MethodType(_lookup_forward, embedding)
    try:
        yield handoff
    finally:
        del embedding.forward, embedding._posttrain_head_gradient
