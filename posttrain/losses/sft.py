"""Supervised fine-tuning losses, full-logits and chunked: NLL, DFT, label smoothing, plus the metrics SFT logs.

All return *sums* over trained tokens; the trainer divides by the number of trained tokens in the
whole effective batch (all accumulation steps and processes), which is what makes
batch 8 x accumulation 1 and batch 1 x accumulation 8 give the same gradient.

Per trained token t with log-probabilities log p over the vocabulary V and target y:
- ``nll``: -log p(y)
- ``dft`` (Dynamic Fine-Tuning, Wu et al. 2025, arXiv 2508.05629): -sg(p(y)) * log p(y), the NLL rescaled by the
  token's own (detached) probability;
- label smoothing eps (nll only): (1 - eps) * -log p(y) + eps * mean_v(-log p(v)) (transformers' LabelSmoother).
Metrics per token: top-1 correct (argmax == y) and the entropy -sum_v p(v) log p(v) of the predicted distribution.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from posttrain.losses.logprobs import softmax_by_rows

IGNORE_INDEX = -100
LOSS_TYPES = ("nll", "dft")


class TokenSums(NamedTuple):
    """Sums over the trained tokens of one micro-batch."""

    loss: torch.Tensor  # differentiable
    correct: torch.Tensor  # argmax == target
    count: torch.Tensor  # trained tokens
    entropy: torch.Tensor  # detached


def shift_for_next_token(labels: torch.Tensor) -> torch.Tensor:
    """Targets aligned with logits: position t predicts token t+1; the last position predicts nothing."""
    return F.pad(labels[..., 1:], (0, 1), value=IGNORE_INDEX)


def _rows_sums(logits: torch.Tensor, targets: torch.Tensor, loss_type: str, label_smoothing: float):
    """(loss sum, correct, entropy sum) for rows of logits [N, V] (any dtype; computed in float32)."""
    logp = F.log_softmax(logits.float(), dim=-1)
    token_logp = logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    per_token = -token_logp
    if loss_type == "dft":
        per_token = per_token * token_logp.detach().exp()
    elif label_smoothing:
        per_token = (1 - label_smoothing) * per_token - label_smoothing * logp.mean(-1)
    with torch.no_grad():
        entropy = -(logp.exp() * logp).sum()
        correct = (logp.argmax(-1) == targets).sum()
    return per_token.sum(), correct, entropy


def token_loss_sums(
    logits: torch.Tensor,
    labels: torch.Tensor,
    loss_type: str = "nll",
    label_smoothing: float = 0.0,
) -> TokenSums:
    """Loss, correct-prediction, token and entropy sums over trained targets.

    logits: [B, T, V]; labels: [B, T] unshifted, -100 where untrained.
    """
    targets = shift_for_next_token(labels)
    keep = targets != IGNORE_INDEX
    loss, correct, entropy = _rows_sums(logits[keep], targets[keep], loss_type, label_smoothing)
    return TokenSums(loss, correct, keep.sum(), entropy)


def nll_sum(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(sum of NLL over trained targets, number of correct argmax predictions, number of trained targets)."""
    sums = token_loss_sums(logits, labels)
    return sums.loss, sums.correct, sums.count


def _chunk_forward_backward(hidden, weight, bias, targets, loss_type: str, label_smoothing: float):
    """One chunk's (loss sum, correct, entropy sum) and the gradient of its loss sum w.r.t. its logits.

    d(loss)/d(logits) in closed form, per token with probabilities p and one-hot target e_y:
    nll: p - e_y; dft: p(y) * (p - e_y) (p(y) is detached); label smoothing: p - (1 - eps) e_y - eps / V.
    The logits buffer becomes the gradient in place (`softmax_by_rows` turns it into p). With the row's
    log-normalizer L: log p(y) = logit_y - L and mean_v log p = mean logit - L.
    """
    grad = F.linear(hidden, weight, bias).float()
    every = torch.arange(len(targets), device=grad.device)
    target_logit = grad[every, targets]
    smoothing = loss_type == "nll" and label_smoothing
    mean_logit = grad.mean(-1) if smoothing else None
    softmax = softmax_by_rows(grad, probs=True, entropy=True)  # grad now holds p
    log_normalizer = softmax.log_normalizer
    entropy = softmax.entropy.sum()
    token_logp = target_logit - log_normalizer
    correct = (softmax.argmax == targets).sum()
    if loss_type == "dft":
        scale = token_logp.exp()
        loss = -(scale * token_logp).sum()
    elif smoothing:
        loss = -((1 - label_smoothing) * token_logp + label_smoothing * (mean_logit - log_normalizer)).sum()
    else:
        loss = -token_logp.sum()
    grad[every, targets] -= 1 - label_smoothing if loss_type == "nll" else 1
    if smoothing:
        grad -= label_smoothing / grad.shape[-1]
    if loss_type == "dft":
        grad *= scale.unsqueeze(-1)
    return loss, correct, entropy, grad


class _FusedHeadLoss(torch.autograd.Function):
    """The output projection and the token loss, chunk by chunk, with each chunk's gradients computed in the
    forward pass (they are known in closed form there): no chunk is recomputed in the backward pass and
    no [tokens, vocab] tensor outlives its chunk. Backward only scales the stored gradients."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, chunk_size, loss_type, label_smoothing, on_weight_grad):
        need_hidden, need_weight = hidden.requires_grad, weight.requires_grad
        need_bias = bias is not None and bias.requires_grad
        grad_hidden = torch.empty_like(hidden) if need_hidden else None
        grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_weight else None
        grad_bias = torch.zeros(bias.shape, dtype=torch.float32, device=bias.device) if need_bias else None
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        entropy = torch.zeros((), dtype=torch.float32, device=hidden.device)
        correct = torch.zeros((), dtype=torch.long, device=hidden.device)
        for start in range(0, hidden.shape[0], chunk_size):
            piece = slice(start, start + chunk_size)
            rows = hidden[piece]
            loss, right, chunk_entropy, grad = _chunk_forward_backward(
                rows, weight, bias, targets[piece], loss_type, label_smoothing
            )
            total += loss
            correct += right
            entropy += chunk_entropy
            if need_hidden:
                grad_hidden[piece] = (grad.to(weight.dtype) @ weight).to(hidden.dtype)
            if need_weight:
                grad_weight.addmm_(grad.t(), rows.float())
            if need_bias:
                grad_bias += grad.sum(0)
            del grad  # before the next chunk's buffers are allocated
        # Kept on ctx (not save_for_backward): they are this function's own intermediates, scaled in place once.
        ctx.grads = (grad_hidden, grad_weight, grad_bias)
        ctx.dtypes = (hidden.dtype, weight.dtype, bias.dtype if bias is not None else None)
        ctx.on_weight_grad = on_weight_grad
        ctx.mark_non_differentiable(correct, entropy)
        return total, correct, entropy

    @staticmethod
    def backward(ctx, grad_total, _grad_correct, _grad_entropy):
        if ctx.grads is None:
            raise RuntimeError("chunked_token_loss_sums supports one backward pass per forward pass.")
        grads = [None if g is None else g.mul_(grad_total).to(dtype) for g, dtype in zip(ctx.grads, ctx.dtypes)]
        ctx.grads = None
        if ctx.on_weight_grad is not None and grads[1] is not None and ctx.on_weight_grad(grads[1]):
            grads[1] = None  # taken over: delivered to autograd with the embedding's rows added
        return (*grads, None, None, None, None, None)


def chunked_token_loss_sums(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    bias: torch.Tensor | None = None,
    chunk_size: int = 1024,
    loss_type: str = "nll",
    label_smoothing: float = 0.0,
    on_weight_grad=None,
) -> TokenSums:
    """`token_loss_sums` from final hidden states and the output projection, without the [tokens, vocab] logits.

    Only trained positions are projected, `chunk_size` rows at a time; each chunk's gradients are computed
    as it goes (see `_FusedHeadLoss`), so peak memory holds one [chunk_size, vocab] buffer and no chunk is
    recomputed. `on_weight_grad`, if given, is called in the backward pass with the weight's gradient; when it
    returns True it has taken the gradient over (a tied input embedding delivers it with its own rows added:
    `models/tied_embedding.py`) and the weight gets none from here.
    """
    if loss_type not in LOSS_TYPES:
        raise ValueError(f"loss_type={loss_type!r} is not one of {LOSS_TYPES}.")
    targets = shift_for_next_token(labels)
    keep = targets != IGNORE_INDEX
    total, correct, entropy = _FusedHeadLoss.apply(
        hidden[keep],
        weight,
        bias,
        targets[keep],
        chunk_size,
        loss_type,
        0.0 if loss_type == "dft" else label_smoothing,
        on_weight_grad,
    )
    return TokenSums(total, correct, keep.sum(), entropy)
