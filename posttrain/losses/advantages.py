"""Advantages for online RL: group-relative (GRPO), leave-one-out (RLOO), GAE (PPO), plus the KL controllers.

Everything here produces *targets*: inputs are detached and nothing is differentiated through.
"""

from __future__ import annotations

import math

import torch

from posttrain.errors import ConfigError
from posttrain.losses.reductions import nanstd

SCALE_REWARDS = ("group", "batch", "none")
MULTI_OBJECTIVE_AGGREGATIONS = ("sum_then_normalize", "normalize_then_sum")


def _grouped(rewards: torch.Tensor, num_generations: int) -> torch.Tensor:
    """View flat rewards [N] as [N / num_generations, num_generations], one row per prompt."""
    if num_generations < 2:
        raise ConfigError(
            f"num_generations={num_generations}: a group-relative advantage needs at least 2 completions "
            "per prompt (with 1 every advantage is 0). Set num_generations >= 2."
        )
    if rewards.dim() != 1 or rewards.numel() % num_generations != 0:
        raise ConfigError(
            f"rewards of shape {tuple(rewards.shape)} cannot be split into groups of num_generations="
            f"{num_generations}: pass a 1-D tensor whose length is a multiple of num_generations "
            "(make the generation batch size a multiple of num_generations)."
        )
    return rewards.detach().view(-1, num_generations)


def group_advantages(
    rewards: torch.Tensor, num_generations: int, scale_rewards: str = "group", eps: float = 1e-4
) -> torch.Tensor:
    """GRPO advantages: each reward minus its group's mean, optionally divided by a standard deviation.

    `rewards` [N] is ordered so that each consecutive block of `num_generations` is one prompt's group.
    scale_rewards: "group" divides by the group's std; "batch" by the std of all N rewards (steadier when
    a group's rewards are nearly equal); "none" does not scale, as Dr. GRPO (Liu et al. 2025) recommends
    because the per-group std weights prompts by their difficulty. The std is the unbiased one (Bessel's
    correction, torch's default); `eps` keeps a group of equal rewards at advantage 0 instead of 0/0.
    """
    if scale_rewards not in SCALE_REWARDS:
        raise ConfigError(f"scale_rewards={scale_rewards!r} is not one of {SCALE_REWARDS}; pick one of them.")
    groups = _grouped(rewards, num_generations)
    centred = groups - groups.mean(dim=1, keepdim=True)
    if scale_rewards == "group":
        centred = centred / (groups.std(dim=1, keepdim=True) + eps)
    elif scale_rewards == "batch":
        centred = centred / (groups.std() + eps)
    return centred.reshape(-1)


def decoupled_advantages(
    rewards_per_function: torch.Tensor, weights: torch.Tensor, num_generations: int, eps: float = 1e-4
) -> torch.Tensor:
    """GDPO advantages (multi_objective_aggregation="normalize_then_sum"): normalise each reward function
    within its group first, then sum with the weights, then normalise over the batch.

    rewards_per_function [N, F] (NaN where a function does not apply), groups of `num_generations`
    consecutive rows. Per function: (r - group mean) / (group std + eps), NaN-aware; their weighted sum
    (NaN entries skipped) is centred and scaled by the batch's mean and std (+ eps). Summing raw rewards
    first would let the function with the largest spread drown the others; normalising each first gives
    every objective its own say. Rows no function applies to, and NaN results, get advantage 0.
    """
    if rewards_per_function.dim() != 2 or weights.numel() != rewards_per_function.shape[1]:
        raise ConfigError(
            f"rewards_per_function {tuple(rewards_per_function.shape)} must be [N, F] with one of "
            f"the {weights.numel()} reward_weights per column."
        )
    per_function = rewards_per_function.detach()
    groups = _grouped(per_function[:, 0], num_generations).shape[0]
    grouped = per_function.reshape(groups, num_generations, -1)
    normalised = (grouped - torch.nanmean(grouped, dim=1, keepdim=True)) / (nanstd(grouped, 1, True) + eps)
    summed = torch.nansum(normalised.reshape(per_function.shape) * weights.to(per_function), dim=1)
    summed[per_function.isnan().all(dim=1)] = torch.nan
    advantages = (summed - torch.nanmean(summed)) / (nanstd(summed) + eps)
    return torch.nan_to_num(advantages, nan=0.0)


def leave_one_out_advantages(rewards: torch.Tensor, num_generations: int) -> torch.Tensor:
    """RLOO advantages: each reward minus the mean of the other k-1 rewards of its group.

    Unlike the group mean, this baseline does not depend on the sample it is subtracted from, so the
    policy-gradient estimate stays unbiased (Ahmadian et al. 2024).
    """
    groups = _grouped(rewards, num_generations)
    others_mean = (groups.sum(dim=1, keepdim=True) - groups) / (num_generations - 1)
    return (groups - others_mean).reshape(-1)


def gae(
    rewards: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor,
    gamma: float,
    lam: float,
    dones: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation (Schulman et al. 2016) over each row's tokens; returns (advantages, returns).

    All inputs are [B, T]. Tokens with mask 0 (padding, on either side) are skipped: the recursion links
    each valid token to the next valid one. After a row's last valid token the episode ends, so nothing is
    bootstrapped from beyond it. `dones[b, t] = True` ends the episode after token t as well (no
    bootstrapping across it; the following tokens start a new episode). With
        delta_t = r_t + gamma * V_next * (1 - done_t) - V_t
        A_t     = delta_t + gamma * lam * (1 - done_t) * A_next
    returns = advantages + values. Both outputs are 0 where mask is 0.
    """
    rewards, values = rewards.detach(), values.detach()
    valid = mask.bool()
    ends = torch.zeros_like(valid) if dones is None else dones.bool()
    advantages = torch.zeros_like(values)
    next_value = torch.zeros_like(values[:, 0])
    next_advantage = torch.zeros_like(values[:, 0])
    for t in reversed(range(values.shape[1])):
        continues = (~ends[:, t]).to(values.dtype)
        delta = rewards[:, t] + gamma * continues * next_value - values[:, t]
        advantage = delta + gamma * lam * continues * next_advantage
        here = valid[:, t]
        advantages[:, t] = torch.where(here, advantage, 0.0)
        next_value = torch.where(here, values[:, t], next_value)
        next_advantage = torch.where(here, advantage, next_advantage)
    returns = torch.where(valid, advantages + values, 0.0)
    return advantages, returns


def whiten(
    values: torch.Tensor, mask: torch.Tensor | None = None, shift_mean: bool = True, eps: float = 1e-8
) -> torch.Tensor:
    """Scale `values` to unit variance (and zero mean if `shift_mean`) using only the entries where mask is 1.

    The variance is unbiased (Bessel's correction), matching `group_advantages`. With shift_mean=False the
    mean is kept, so the sign of a positive-mean advantage batch is preserved. Entries with mask 0 come
    back as 0.
    """
    values = values.detach()
    valid = torch.ones_like(values, dtype=torch.bool) if mask is None else mask.bool()
    count = valid.sum()
    if count < 2:
        raise ConfigError(
            f"whiten needs at least 2 valid entries to estimate a variance, got {int(count)}: use a larger "
            "batch or turn advantage whitening off."
        )
    weights = valid.to(values.dtype)
    mean = (values * weights).sum() / count
    variance = (((values - mean) * weights) ** 2).sum() / (count - 1)
    whitened = (values - mean) * torch.rsqrt(variance + eps)
    if not shift_mean:
        whitened = whitened + mean
    return torch.where(valid, whitened, 0.0)


class AdaptiveKLController:
    """Adaptive KL coefficient of Ziegler et al. 2019: nudges the coefficient so the observed KL tracks `target`.

    Each update multiplies the coefficient by 1 + e * n_steps / horizon, where
    e = clip(current_kl / target - 1, -0.2, 0.2) is the clipped proportional error.
    """

    def __init__(self, init_kl_coef: float, target: float, horizon: float) -> None:
        if target <= 0 or horizon <= 0:
            raise ConfigError(
                f"AdaptiveKLController needs target > 0 and horizon > 0, got target={target}, horizon={horizon}."
            )
        self.value = init_kl_coef
        self.target = target
        self.horizon = horizon

    def update(self, current_kl: float, n_steps: int) -> None:
        proportional_error = min(max(float(current_kl) / self.target - 1.0, -0.2), 0.2)
        self.value *= 1.0 + proportional_error * n_steps / self.horizon


class FixedKLController:
    """Constant KL coefficient with the same interface as `AdaptiveKLController`."""

    def __init__(self, kl_coef: float) -> None:
        self.value = kl_coef

    def update(self, current_kl: float, n_steps: int) -> None:
        """The coefficient is fixed: nothing to update."""


class AdaptiveEntropyController:
    """Adaptive entropy-bonus coefficient of Skywork-OR1 (He et al. 2025): raises the coefficient by `delta`
    after an optimizer step whose mean token entropy was at or below `target`, lowers it otherwise, within
    [coef_min, coef_max]. The bonus only applies while the last measured entropy is at or below the target
    (none before the first measurement), so it acts against entropy collapse and stays off otherwise.
    `state()` / `load_state()` carry the two numbers a resumed run needs.
    """

    def __init__(self, coef: float, target: float, delta: float, coef_min: float, coef_max: float) -> None:
        if not coef_min <= coef_max or delta < 0:
            raise ConfigError(
                f"Adaptive entropy control needs entropy_coef_min ({coef_min}) <= entropy_coef_max "
                f"({coef_max}) and entropy_coef_delta ({delta}) >= 0."
            )
        self.coef, self.target, self.delta = coef, target, delta
        self.coef_min, self.coef_max = coef_min, coef_max
        self.last_entropy = math.inf

    def applied_coef(self) -> float:
        """The coefficient the bonus uses during the current optimizer step."""
        return self.coef if self.last_entropy <= self.target else 0.0

    def update(self, entropy: float) -> None:
        """After an optimizer step, with that step's mean token entropy (all micro-batches and processes)."""
        if entropy <= self.target:
            self.coef = min(self.coef + self.delta, self.coef_max)
        else:
            self.coef = max(self.coef - self.delta, self.coef_min)
        self.last_entropy = float(entropy)

    def state(self) -> dict[str, float]:
        return {"entropy_coef": self.coef, "last_world_entropy": self.last_entropy}

    def load_state(self, state: dict[str, float]) -> None:
        self.coef, self.last_entropy = float(state["entropy_coef"]), float(state["last_world_entropy"])
