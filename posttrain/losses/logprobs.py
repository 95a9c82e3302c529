"""Log-probabilities of given tokens, the quantity every preference and policy loss starts from."""

from __future__ import annotations

import torch


def selective_log_softmax(logits: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """log_softmax(logits)[..., index] without keeping the full [.., vocab] log-softmax around.

    logits: [..., V]; index: [...] (same leading shape). Computed in float32 at least.
    """
    logits = logits.float() if logits.dtype in (torch.float16, torch.bfloat16) else logits
    picked = torch.gather(logits, -1, index.unsqueeze(-1)).squeeze(-1)
    return picked - torch.logsumexp(logits, dim=-1)


def next_token_logps(logits: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
    """Per-token log-probs of `input_ids` under `logits` ([B, T, V]), aligned with input_ids: entry t is
    log p(input_ids[t] | input_ids[:t]); entry 0 has no prediction and is 0."""
    logps = selective_log_softmax(logits[:, :-1], input_ids[:, 1:])
    return torch.nn.functional.pad(logps, (1, 0), value=0.0)
