"""Policy and value losses for online RL (GRPO, RLOO, PPO): clipped surrogate, KL, value loss, aggregation.

Shapes: B sequences (completions) of T tokens, right-padded; `mask` [B, T] is 1 on completion tokens.
Per-token functions return 0 where mask is 0, so padding never reaches a gradient.
"""

from __future__ import annotations

import torch

from posttrain.errors import ConfigError

IMPORTANCE_SAMPLING_LEVELS = ("token", "sequence")
LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo")


def kl_k3(logps: torch.Tensor, ref_logps: torch.Tensor) -> torch.Tensor:
    """Per-token k3 estimator of KL(policy || reference) from tokens sampled by the policy.

    With d = ref_logps - logps: exp(d) - d - 1 (Schulman, "Approximating KL divergence", 2020). It is
    unbiased, never negative, and has lower variance than -d. expm1 keeps it accurate for small d.
    """
    log_ratio = ref_logps - logps
    return torch.expm1(log_ratio) - log_ratio


def _masked_mean(values: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    return (values * valid).sum() / valid.sum().clamp(min=1)


def clipped_policy_loss(
    logps: torch.Tensor,
    old_logps: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    epsilon_low: float = 0.2,
    epsilon_high: float | None = None,
    importance_sampling_level: str = "token",
    ref_logps: torch.Tensor | None = None,
    beta: float = 0.0,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO/GRPO clipped surrogate per token: -min(r * A, clip(r, 1 - eps_low, 1 + eps_high) * A) [+ beta * k3].

    r = exp(logps - old_logps). `advantages` is [B] (one per sequence, GRPO/RLOO) or [B, T] (PPO).
    epsilon_high defaults to epsilon_low; a larger one lets low-probability tokens grow (DAPO "clip-higher").
    importance_sampling_level="sequence" is GSPO (Zheng et al. 2025): every token of a sequence uses
    the sequence's length-normalised log ratio, mean over its valid tokens of (logps - old_logps), so the
    whole sequence is clipped together. With beta > 0 the k3 KL to `ref_logps` is added per token.

    Returns (per_token_loss [B, T], stats). stats, all detached, are fractions of valid tokens:
    "clip_ratio_low" (r below 1 - eps_low with A < 0), "clip_ratio_high" (r above 1 + eps_high with A > 0),
    "clip_ratio" (either: the tokens whose gradient the clip removes), and "kl" (mean k3) when
    ref_logps is given.
    """
    epsilon_high = epsilon_low if epsilon_high is None else epsilon_high
    if not (0 <= epsilon_low < 1 and epsilon_high >= 0):
        raise ConfigError(
            f"epsilon_low={epsilon_low}, epsilon_high={epsilon_high}: the clip range needs "
            "0 <= epsilon_low < 1 and epsilon_high >= 0 (typical: 0.2 and 0.2-0.28)."
        )
    if importance_sampling_level not in IMPORTANCE_SAMPLING_LEVELS:
        raise ConfigError(
            f"importance_sampling_level={importance_sampling_level!r} is not one of {IMPORTANCE_SAMPLING_LEVELS}."
        )
    if beta > 0 and ref_logps is None:
        raise ConfigError(f"beta={beta} adds a KL penalty but no ref_logps were given: pass them or set beta=0.")

    # Zero the padding first, so that whatever it holds (even -inf) cannot reach a value or a gradient.
    valid = mask.bool()
    weights = valid.to(logps.dtype)
    logps = torch.where(valid, logps, 0.0)
    log_ratio = logps - torch.where(valid, old_logps.detach(), 0.0)
    if importance_sampling_level == "sequence":
        sequence_log_ratio = log_ratio.sum(dim=1, keepdim=True) / weights.sum(dim=1, keepdim=True).clamp(min=1)
        log_ratio = sequence_log_ratio.expand_as(log_ratio)
    if advantages.dim() == 1:
        advantages = advantages.unsqueeze(1)
    advantages = advantages.detach()

    ratio = torch.exp(log_ratio)
    clipped_ratio = torch.clamp(ratio, 1 - epsilon_low, 1 + epsilon_high)
    loss = -torch.min(ratio * advantages, clipped_ratio * advantages)

    stats = {}
    if ref_logps is not None:
        kl = kl_k3(logps, torch.where(valid, ref_logps.detach(), 0.0))
        if beta > 0:
            loss = loss + beta * kl
        stats["kl"] = _masked_mean(kl.detach(), weights)
    with torch.no_grad():
        low = (ratio < 1 - epsilon_low) & (advantages < 0)
        high = (ratio > 1 + epsilon_high) & (advantages > 0)
        stats["clip_ratio_low"] = _masked_mean(low.to(weights.dtype), weights)
        stats["clip_ratio_high"] = _masked_mean(high.to(weights.dtype), weights)
        stats["clip_ratio"] = _masked_mean((low | high).to(weights.dtype), weights)
    return torch.where(valid, loss, 0.0), stats


def aggregate_loss(
    per_token_loss: torch.Tensor,
    mask: torch.Tensor,
    loss_type: str,
    *,
    total_sequences: int | torch.Tensor | None = None,
    total_tokens: int | torch.Tensor | None = None,
    max_completion_length: int | None = None,
) -> torch.Tensor:
    """Reduce a per-token loss [B, T] to a scalar; l = per_token_loss, m = mask, n_i = sum_t m_it.

    - "grpo":    sum_i (sum_t l_it m_it / n_i) / total_sequences   (mean per sequence, then over sequences)
    - "bnpo":    sum_it l_it m_it / total_tokens
    - "dr_grpo": sum_it l_it m_it / (total_sequences * max_completion_length)   (Dr. GRPO, Liu et al. 2025)
    - "dapo":    sum_it l_it m_it / total_tokens, total_tokens required (DAPO, Yu et al. 2025)

    total_sequences and total_tokens default to this batch's own counts (B and sum m). Gradient
    accumulation and data parallelism must not change the gradient, so the engine passes the counts
    of the *whole optimizer step* (all accumulation micro-batches, all processes): each call then
    returns its micro-batch's share, and the shares sum to the full-batch loss. That makes every type
    split-invariant given the global counts: grpo and dr_grpo through total_sequences, bnpo and dapo
    through total_tokens. "bnpo" with its default (local token count) is the one that is not: it
    normalises each micro-batch separately. "dapo" insists on the global count, which is its definition.
    The caller undoes the Trainer's division by accumulation steps and DDP's mean over processes.
    """
    if loss_type not in LOSS_TYPES:
        raise ConfigError(f"loss_type={loss_type!r} is not one of {LOSS_TYPES}; pick one of them.")
    weights = mask.to(per_token_loss.dtype)
    masked = per_token_loss * weights
    if total_sequences is None:
        total_sequences = per_token_loss.shape[0]
    if loss_type == "grpo":
        per_sequence = masked.sum(dim=1) / weights.sum(dim=1).clamp(min=1)
        return per_sequence.sum() / total_sequences
    if loss_type == "dr_grpo":
        if max_completion_length is None:
            raise ConfigError("loss_type='dr_grpo' normalises by max_completion_length: pass it.")
        return masked.sum() / (total_sequences * max_completion_length)
    if total_tokens is None:
        if loss_type == "dapo":
            raise ConfigError(
                "loss_type='dapo' normalises by the number of completion tokens in the whole optimizer-step "
                "batch: pass total_tokens (or use loss_type='bnpo' for the local count)."
            )
        total_tokens = weights.sum().clamp(min=1)
    return masked.sum() / total_tokens


def clipped_value_loss(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    mask: torch.Tensor,
    cliprange_value: float,
) -> torch.Tensor:
    """PPO value loss per token: 0.5 * max((v - R)^2, (clip(v, v_old - c, v_old + c) - R)^2).

    Taking the larger of the two keeps the value head from moving more than c per update in the
    direction that would lower the loss. 0 where mask is 0.
    """
    returns, old_values = returns.detach(), old_values.detach()
    clipped_values = torch.clamp(values, old_values - cliprange_value, old_values + cliprange_value)
    loss = 0.5 * torch.max((values - returns) ** 2, (clipped_values - returns) ** 2)
    return torch.where(mask.bool(), loss, 0.0)


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of the softmax over the last dimension, [..., V] -> [...], in the logits' dtype.

    Computed from log_softmax, so large logits do not overflow; logits of -inf (banned tokens) contribute
    0 and keep the gradient finite.
    """
    logps = torch.log_softmax(logits, dim=-1)
    finite_logps = logps.masked_fill(torch.isneginf(logps), 0.0)
    return -(logps.exp() * finite_logps).sum(dim=-1)


def truncated_importance_weights(
    trainer_logps: torch.Tensor, sampler_logps: torch.Tensor, cap: float
) -> torch.Tensor:
    """Per-token weights min(exp(trainer_logps - sampler_logps), cap), detached.

    They correct for the sampler (e.g. vLLM) and the trainer computing slightly different probabilities
    for the same tokens; the cap bounds the variance (truncated importance sampling).
    """
    if cap <= 0:
        raise ConfigError(f"importance-sampling cap={cap} must be > 0 (typical: 2.0).")
    with torch.no_grad():
        return torch.exp(trainer_logps - sampler_logps).clamp(max=cap)
