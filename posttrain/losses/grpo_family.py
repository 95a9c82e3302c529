"""Objectives of GRPO's relatives that are not a per-token surrogate of `policy_objective`.

- GMPO (Zhao et al. 2025, "Geometric-Mean Policy Optimization", arXiv:2507.20673): maximises the geometric mean
  of the token importance ratios of a completion instead of their arithmetic mean; clipping happens per token in
  log space, so one outlier token cannot blow up the sequence's weight and a wider clip range is stable.
- A*-PO (Brantley et al. 2025, "Accelerating RL for LLM Reasoning with Optimal Advantage Regression",
  arXiv:2505.20686): estimates the optimal value V*(x) once from reference samples, then regresses the policy's
  implicit reward beta2 * log(pi / pi_ref) of one on-policy completion onto the optimal advantage r - V*(x).

Shapes: B completions of T tokens, right-padded; `mask` [B, T] is 1 on trained tokens.
"""

from __future__ import annotations

import math

import torch

from posttrain.losses.policy import clip_stats, kl_k3
from posttrain.losses.reductions import masked_mean


def gmpo_objective(
    logps: torch.Tensor,
    old_logps: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    epsilon_low: float = 0.4,
    epsilon_high: float | None = None,
    keep: torch.Tensor | None = None,
    ref_logps: torch.Tensor | None = None,
    beta: float = 0.0,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """GMPO's loss per completion [B] and its statistics.

    With l_t = log pi(y_t) - log pi_old(y_t), each token's log ratio is clipped to [-eps_low, eps_high] on the side
    the advantage A pushes (A > 0: min(l_t, clip(l_t)); else max(l_t, clip(l_t)) -- PPO's pessimistic min in log
    space), and the completion's weight is the geometric mean exp(sum_t m_t l'_t / sum_t m_t) over the tokens
    `keep` selects (m = mask * keep). Loss_i = -weight_i * A_i + beta * (mean over the mask of the k3 KL to
    `ref_logps`). Stats: clip fractions over the mask (tokens whose l_t lies beyond the clip on the side A
    pushes) under policy_objective's keys, and "kl".
    """
    epsilon_high = epsilon_low if epsilon_high is None else epsilon_high
    valid = mask.bool()
    weights = valid.to(logps.dtype)
    logps = torch.where(valid, logps, 0.0)
    log_ratio = logps - torch.where(valid, old_logps.detach(), 0.0)
    advantages = advantages.detach().reshape(advantages.shape[0], -1)[:, :1]  # [B, 1]
    clamped = log_ratio.clamp(-epsilon_low, epsilon_high)
    clipped = torch.where(advantages > 0, torch.minimum(log_ratio, clamped), torch.maximum(log_ratio, clamped))
    selected = weights if keep is None else weights * keep.to(weights.dtype)
    mean_log_ratio = (clipped * selected).sum(1) / selected.sum(1).clamp(min=1)
    loss = -torch.exp(mean_log_ratio) * advantages.squeeze(1)
    stats: dict[str, torch.Tensor] = {}
    with torch.no_grad():
        low = (log_ratio < -epsilon_low) & (advantages < 0)
        high = (log_ratio > epsilon_high) & (advantages > 0)
        stats.update(clip_stats(low, high, weights))
    if ref_logps is not None:
        kl = kl_k3(logps, torch.where(valid, ref_logps.detach(), 0.0))
        if beta > 0:
            loss = loss + beta * (kl * weights).sum(1) / weights.sum(1).clamp(min=1)
        stats["kl"] = masked_mean(kl.detach(), weights)
    return loss, stats


def a2po_optimal_values(rewards: torch.Tensor, beta1: float) -> torch.Tensor:
    """V*(x) = beta1 * log(mean_i exp(r_i / beta1)) per prompt from `rewards` [P, N] of N reference samples each
    (a soft maximum: beta1 -> 0 gives the best reward, beta1 -> inf the mean). Computed with logsumexp."""
    return beta1 * (torch.logsumexp(rewards / beta1, dim=1) - math.log(rewards.shape[1]))


def a2po_loss(
    sequence_logps: torch.Tensor,
    ref_sequence_logps: torch.Tensor,
    rewards: torch.Tensor,
    optimal_values: torch.Tensor,
    beta2: float,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """A*-PO's squared regression per completion [B]: (beta2 * (log pi(y|x) - log pi_ref(y|x)) - (r - V*(x)))^2,
    with sequence log-probs summed over the completion. Stats: "implicit_reward" and "advantage" (their means)."""
    implicit_reward = beta2 * (sequence_logps - ref_sequence_logps.detach())
    target = (rewards - optimal_values).detach()
    return (implicit_reward - target) ** 2, {
        "implicit_reward": implicit_reward.detach().mean(),
        "advantage": target.mean(),
    }
