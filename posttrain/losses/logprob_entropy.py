"""The selected token's log-probability and the distribution's entropy, from one log-softmax of the logits."""

from __future__ import annotations

import torch


def selective_log_softmax_and_entropy(
    logits: torch.Tensor,
    index: torch.Tensor,
    entropy_requires_grad: bool = True,
    temperature: float = 1.0,
    row_mask: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(log p[index], entropy) per row of `logits` [..., V] / `temperature`, computed in float32 (float64 logits
    stay float64). Rows where `row_mask` (shaped like `index`) is 0 give 0 for both and are not computed; with
    `entropy_requires_grad=False` the entropy is detached."""
    dtype = torch.float64 if logits.dtype == torch.float64 else torch.float32
    logps = torch.zeros(index.shape, dtype=dtype, device=logits.device)
    entropy = torch.zeros(index.shape, dtype=dtype, device=logits.device)
    rows = torch.ones_like(index, dtype=torch.bool) if row_mask is None else row_mask.bool()
    log_probs = torch.log_softmax(logits[rows].to(dtype) / temperature, dim=-1)
    logps[rows] = log_probs.gather(-1, index[rows].unsqueeze(-1)).squeeze(-1)
    with torch.set_grad_enabled(entropy_requires_grad and torch.is_grad_enabled()):
        entropy[rows] = -(log_probs.exp() * log_probs).sum(-1)
    return logps, entropy if entropy_requires_grad else entropy.detach()


__all__ = ["selective_log_softmax_and_entropy"]
