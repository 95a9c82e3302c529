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
from torch.utils.checkpoint import checkpoint

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
    logits: torch.Tensor, labels: torch.Tensor, loss_type: str = "nll", label_smoothing: float = 0.0,
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


def _chunk_sums(hidden, weight, bias, targets, loss_type: str, label_smoothing: float):
    return _rows_sums(F.linear(hidden, weight, bias), targets, loss_type, label_smoothing)


def chunked_token_loss_sums(
    hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, bias: torch.Tensor | None = None,
    chunk_size: int = 1024, loss_type: str = "nll", label_smoothing: float = 0.0,
) -> TokenSums:
    """`token_loss_sums` from final hidden states and the output projection, without the [tokens, vocab] logits.

    Only trained positions are projected, `chunk_size` rows at a time, each chunk recomputed in the
    backward pass (activation checkpointing), so peak memory holds one chunk's logits.
    """
    targets = shift_for_next_token(labels)
    keep = targets != IGNORE_INDEX
    rows, wanted = hidden[keep], targets[keep]
    total = hidden.new_zeros((), dtype=torch.float32)
    entropy = hidden.new_zeros((), dtype=torch.float32)
    correct = torch.zeros((), dtype=torch.long, device=hidden.device)
    for start in range(0, rows.shape[0], chunk_size):
        piece = slice(start, start + chunk_size)
        loss, right, chunk_entropy = checkpoint(_chunk_sums, rows[piece], weight, bias, wanted[piece], loss_type,
                                                label_smoothing, use_reentrant=False)
        total = total + loss
        correct = correct + right
        entropy = entropy + chunk_entropy
    return TokenSums(total, correct, keep.sum(), entropy)


def chunked_nll_sum(
    hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, bias: torch.Tensor | None = None,
    chunk_size: int = 1024,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`nll_sum` from final hidden states and the output projection (see `chunked_token_loss_sums`)."""
    sums = chunked_token_loss_sums(hidden, weight, labels, bias, chunk_size)
    return sums.loss, sums.correct, sums.count
