"""How far the sampler's log-probs are from the trainer's (any generation backend that returns them: vLLM's)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from posttrain.generation.base import Completion


def sampler_logps_tensor(completions: Sequence[Completion], width: int) -> torch.Tensor | None:
    """The sampler's log-probs right-padded with 0 to [N, width], or None when a completion has none."""
    if not completions or any(c.logprobs is None for c in completions):
        return None
    return torch.tensor(
        [list(c.logprobs) + [0.0] * (width - len(c.logprobs)) for c in completions], dtype=torch.float32
    )


def sampler_mismatch_metrics(
    trainer_logps: torch.Tensor, sampler_logps: torch.Tensor, mask: torch.Tensor
) -> dict[str, torch.Tensor]:
    """How far the sampler's log-probs of the sampled tokens are from the trainer's, over `mask`'s tokens:
    mean and max absolute difference (nats), and the mean ratio exp(trainer - sampler). In fp32 with the
    same weights they agree to ~1e-4; more means a weight-sync problem, lower precision, or a stale sampler."""
    valid = mask.bool()
    diff = (trainer_logps.detach().float() - sampler_logps.float())[valid]
    if diff.numel() == 0:
        zero = torch.zeros((), device=trainer_logps.device)
        return {"sampler/logp_diff_mean": zero, "sampler/logp_diff_max": zero, "sampler/ratio_mean": zero + 1}
    return {
        "sampler/logp_diff_mean": diff.abs().mean(),
        "sampler/logp_diff_max": diff.abs().max(),
        "sampler/ratio_mean": diff.exp().mean(),
    }
