"""Negative log-likelihood for supervised fine-tuning, full-logits and chunked.

Both return *sums* over trained tokens; the trainer divides by the number of trained tokens in the
whole effective batch (all accumulation steps and processes), which is what makes
batch 8 x accumulation 1 and batch 1 x accumulation 8 give the same gradient.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

IGNORE_INDEX = -100


def shift_for_next_token(labels: torch.Tensor) -> torch.Tensor:
    """Targets aligned with logits: position t predicts token t+1; the last position predicts nothing."""
    return F.pad(labels[..., 1:], (0, 1), value=IGNORE_INDEX)


def nll_sum(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(sum of NLL over trained targets, number of correct argmax predictions, number of trained targets).

    logits: [B, T, V]; labels: [B, T] unshifted, -100 where untrained. Computed in float32.
    """
    targets = shift_for_next_token(labels)
    keep = targets != IGNORE_INDEX
    picked = logits[keep].float()
    wanted = targets[keep]
    loss = F.cross_entropy(picked, wanted, reduction="sum")
    correct = (picked.argmax(-1) == wanted).sum()
    return loss, correct, keep.sum()


def _chunk_nll(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, targets: torch.Tensor):
    logits = F.linear(hidden, weight, bias).float()
    return F.cross_entropy(logits, targets, reduction="sum"), (logits.argmax(-1) == targets).sum()


def chunked_nll_sum(
    hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, bias: torch.Tensor | None = None,
    chunk_size: int = 1024,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`nll_sum` from final hidden states and the output projection, without the [tokens, vocab] logits.

    Only trained positions are projected, `chunk_size` rows at a time, each chunk recomputed in the
    backward pass (activation checkpointing), so peak memory holds one chunk's logits.
    """
    targets = shift_for_next_token(labels)
    keep = targets != IGNORE_INDEX
    rows, wanted = hidden[keep], targets[keep]
    total = hidden.new_zeros((), dtype=torch.float32)
    correct = torch.zeros((), dtype=torch.long, device=hidden.device)
    for start in range(0, rows.shape[0], chunk_size):
        piece = slice(start, start + chunk_size)
        loss, right = checkpoint(_chunk_nll, rows[piece], weight, bias, wanted[piece], use_reentrant=False)
        total = total + loss
        correct = correct + right
    return total, correct, keep.sum()
