"""Which completion tokens carry the policy loss, and with what weight: high-entropy token selection, off-policy
sequence masking and the sampler-mismatch importance weights. All outputs are detached selections or weights
that multiply `policy_objective`'s policy term ([B, T] or [B, 1], right-padded `mask` [B, T] as there).
"""

from __future__ import annotations

import math

import torch

from posttrain.errors import ConfigError

IMPORTANCE_SAMPLING_MODES = ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask")


def high_entropy_mask(
    entropy: torch.Tensor, mask: torch.Tensor, top_quantile: float, population: torch.Tensor | None = None
) -> torch.Tensor:
    """True [B, T] on the valid tokens whose entropy is in the top `top_quantile` fraction (Wang et al. 2025,
    "Beyond the 80/20 rule": the gradient of the few high-entropy "forking" tokens carries the learning).

    The threshold is the (1 - top_quantile) quantile, linearly interpolated as torch.quantile, of
    `population` (the valid entropies of every process; default: this batch's valid entropies); a token is
    kept when its entropy is >= the threshold. top_quantile=1 keeps every token, 0 only the highest.
    """
    if not 0.0 <= top_quantile <= 1.0:
        raise ConfigError(f"top_entropy_quantile={top_quantile} must be in [0, 1] (the paper uses 0.2).")
    valid = mask.bool()
    entropy = entropy.detach()
    population = entropy[valid] if population is None else population.detach()
    if population.numel() == 0:
        return torch.zeros_like(valid)
    population = population.to(torch.promote_types(population.dtype, torch.float32))  # quantile needs >= fp32
    threshold = torch.quantile(population, 1.0 - top_quantile)
    return (entropy >= threshold.to(entropy.dtype)) & valid


def off_policy_sequence_mask(
    logps: torch.Tensor,
    behaviour_logps: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    threshold: float,
) -> torch.Tensor:
    """1.0 / 0.0 [B, 1]: keep a sequence unless its advantage is negative and its mean per-token
    log(pi_behaviour / pi) over valid tokens exceeds `threshold` (DeepSeek-V3.2, eq. 9): negative samples the
    policy has drifted far from mostly add noise. Tokens whose behaviour log-prob is NaN count as 0.
    """
    if threshold <= 0:
        raise ConfigError(f"off_policy_mask_threshold={threshold} must be > 0 (e.g. 0.5), or None to turn it off.")
    weights = mask.to(logps.dtype)
    divergence = torch.nan_to_num(behaviour_logps.detach() - logps.detach(), nan=0.0) * weights
    mean_divergence = divergence.sum(dim=1, keepdim=True) / weights.sum(dim=1, keepdim=True).clamp(min=1)
    advantages = advantages.detach().reshape(advantages.shape[0], -1)[:, :1]
    return ((advantages >= 0) | (mean_divergence <= threshold)).to(logps.dtype)


def sampler_importance_weights(
    trainer_logps: torch.Tensor,
    sampler_logps: torch.Tensor,
    mask: torch.Tensor,
    mode: str = "sequence_mask",
    clip_min: float | None = None,
    clip_max: float | None = 3.0,
) -> torch.Tensor:
    """Importance weights pi_trainer / pi_sampler correcting for the sampler (e.g. vLLM) computing slightly
    different probabilities than the trainer for the tokens it sampled; detached.

    mode = granularity + constraint: "token_*" gives one ratio per token [B, T]; "sequence_*" one per sequence
    [B, 1], the product of its token ratios (exp of the summed log differences). "*_truncate" clamps the ratio
    to [clip_min, clip_max] (truncated IS); "*_mask" sets ratios outside it to 0 (masked IS: the token or
    sequence leaves the loss). A None bound is open. Padding and tokens the sampler could not score (NaN)
    contribute ratio 1.
    """
    if mode not in IMPORTANCE_SAMPLING_MODES:
        raise ConfigError(f"vllm_importance_sampling_mode={mode!r} is not one of {IMPORTANCE_SAMPLING_MODES}.")
    with torch.no_grad():
        log_diff = torch.nan_to_num((trainer_logps - sampler_logps) * mask.to(trainer_logps.dtype), nan=0.0)
        if mode.startswith("sequence"):
            log_diff = log_diff.sum(dim=1, keepdim=True)
        ratio = torch.exp(log_diff)
        if mode.endswith("truncate"):
            return torch.clamp(ratio, min=clip_min, max=clip_max)
        low = -math.inf if clip_min is None else clip_min
        high = math.inf if clip_max is None else clip_max
        return ratio.masked_fill((ratio < low) | (ratio > high), 0.0)


def sampler_ratio_metrics(
    ratio: torch.Tensor, trainer_logps: torch.Tensor, sampler_logps: torch.Tensor, mask: torch.Tensor
) -> dict[str, torch.Tensor]:
    """TRL's sampling/* metrics over valid tokens: |trainer - sampler| log-prob difference (mean, max; NaN
    tokens left out) and the importance ratio's min, mean and max (over tokens, or over sequences)."""
    valid = mask.bool()
    difference = (trainer_logps.detach() - sampler_logps).abs()[valid]
    difference = difference[~difference.isnan()]
    flat = ratio.flatten() if ratio.shape[1] == 1 else ratio[valid]
    zero = torch.zeros((), dtype=ratio.dtype, device=ratio.device)

    def reduce(values, fn):
        return fn(values) if values.numel() else zero

    return {
        "sampling/sampling_logp_difference/mean": reduce(difference, torch.mean),
        "sampling/sampling_logp_difference/max": reduce(difference, torch.max),
        "sampling/importance_sampling_ratio/min": reduce(flat, torch.min),
        "sampling/importance_sampling_ratio/mean": reduce(flat, torch.mean),
        "sampling/importance_sampling_ratio/max": reduce(flat, torch.max),
    }
