"""Policy and value losses for online RL (GRPO, RLOO, PPO): clipped surrogate, KL, value loss, aggregation.

Shapes: B sequences (completions) of T tokens, right-padded; `mask` [B, T] is 1 on completion tokens.
Per-token functions return 0 where mask is 0, so padding never reaches a gradient.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from posttrain.errors import ConfigError
from posttrain.losses.reductions import masked_mean

IMPORTANCE_SAMPLING_LEVELS = ("token", "sequence", "sequence_token")


@dataclass(frozen=True)
class VespoParams:
    """Shape of VESPO's gamma weight phi(w) = exp(lam) * w^k * exp(-lam * w), per advantage sign."""

    k_pos: float = 2.0
    lambda_pos: float = 3.0
    k_neg: float = 3.0
    lambda_neg: float = 2.0


def kl_k3(logps: torch.Tensor, ref_logps: torch.Tensor) -> torch.Tensor:
    """Per-token k3 estimator of KL(policy || reference) from tokens sampled by the policy.

    With d = ref_logps - logps: exp(d) - d - 1 (Schulman, "Approximating KL divergence", 2020). It is
    unbiased, never negative, and has lower variance than -d. expm1 keeps it accurate for small d.
    """
    log_ratio = ref_logps - logps
    return torch.expm1(log_ratio) - log_ratio


def kl_estimate(logps: torch.Tensor, ref_logps: torch.Tensor, estimator: str = "k1") -> torch.Tensor:
    """Per-token KL(pi || pi_ref) estimate from the sampled tokens' log-probs: k1 = log pi - log pi_ref (unbiased,
    may be negative per token), or k3 (`kl_k3`)."""
    if estimator not in ("k1", "k3"):
        raise ConfigError(f"kl_estimator={estimator!r} must be 'k1' or 'k3'.")
    return logps - ref_logps if estimator == "k1" else kl_k3(logps, ref_logps)


def _choose(condition: torch.Tensor, if_true: float, if_false: float, like: torch.Tensor) -> torch.Tensor:
    """torch.where of two numbers in `like`'s dtype (python floats would round through float32)."""
    return torch.where(
        condition,
        torch.tensor(if_true, dtype=like.dtype, device=like.device),
        torch.tensor(if_false, dtype=like.dtype, device=like.device),
    )


def vespo_weights(
    log_ratio: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    params: VespoParams = VespoParams(),
    sampler_ratio: torch.Tensor | None = None,
) -> torch.Tensor:
    """VESPO's per-sequence weight phi(w) [B, 1], detached (VESPO, 2026).

    w = exp(sum_t log_ratio_t) is the sequence's importance weight (a sum, not GSPO's mean), times the
    product of the per-token sampler correction `sampler_ratio` when given. phi(w) = exp(lam + k log w - lam w)
    peaks at phi(1) = 1 and decays smoothly for w far from 1, replacing the hard clip; (k, lam) are
    (k_pos, lambda_pos) for advantages >= 0, else the _neg pair. Each token's log ratio is clamped to
    [-20, 20] and log w to [log 1e-8, 20] so that exp cannot overflow.
    """
    floor = math.log(1e-8)
    with torch.no_grad():
        weights = mask.to(log_ratio.dtype)
        log_w = (log_ratio.detach().clamp(-20.0, 20.0) * weights).sum(dim=1, keepdim=True)
        if sampler_ratio is not None:
            log_w = log_w + torch.log(sampler_ratio).clamp(floor, 20.0).sum(dim=1, keepdim=True)
        log_w = log_w.clamp(floor, 20.0)
        advantages = advantages.reshape(advantages.shape[0], -1)[:, :1]
        non_negative = advantages >= 0
        k = _choose(non_negative, params.k_pos, params.k_neg, log_w)
        lam = _choose(non_negative, params.lambda_pos, params.lambda_neg, log_w).clamp(min=1e-4)
        phi = torch.exp(lam + k * log_w - lam * torch.exp(log_w))
        return phi.nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)


@dataclass(frozen=True)
class TokenTerms:
    """What a loss type's per-token term reads (`policy_objective` builds it): the importance ratio r ([B, T], or
    [B, 1] at sequence level), the detached advantages ([B, 1] or [B, T]), the log-probs and per-token log ratios
    with the padding zeroed, the valid tokens (bool, and as weights), and the options that shape the terms."""

    ratio: torch.Tensor
    advantages: torch.Tensor
    logps: torch.Tensor
    token_log_ratio: torch.Tensor
    valid: torch.Tensor
    weights: torch.Tensor
    sampler_ratio: torch.Tensor | None
    epsilon_low: float
    epsilon_high: float
    delta: float | None
    sapo_temperature_pos: float
    sapo_temperature_neg: float
    vespo: VespoParams


def clipped_term(t: TokenTerms) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The PPO clip: -min(r A, clip(r, 1 - eps_low, 1 + eps_high) A); with `delta` the unclipped r is also capped
    at delta (two-sided clipping, INTELLECT-2), so a negative advantage cannot push a very large ratio further.
    Stats: the clip fractions (`clip_stats`)."""
    clipped_ratio = torch.clamp(t.ratio, 1 - t.epsilon_low, 1 + t.epsilon_high)
    capped_ratio = t.ratio if t.delta is None else torch.clamp(t.ratio, max=t.delta)
    loss = -torch.min(capped_ratio * t.advantages, clipped_ratio * t.advantages)
    with torch.no_grad():
        low = (capped_ratio < 1 - t.epsilon_low) & (t.advantages < 0)
        high = (capped_ratio > 1 + t.epsilon_high) & (t.advantages > 0)
        return loss, clip_stats(low, high, t.weights)


def cispo_term(t: TokenTerms) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """CISPO (MiniMax-M1): -sg(min(r, eps_high)) A log pi: clips the weight, never drops a token's gradient.
    Stats: "cispo_clip_ratio"."""
    loss = -torch.clamp(t.ratio, max=t.epsilon_high).detach() * t.advantages * t.logps
    with torch.no_grad():
        return loss, {"cispo_clip_ratio": _fraction((t.ratio > t.epsilon_high) & (t.advantages > 0), t.weights)}


def sapo_term(t: TokenTerms) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """SAPO: -(4 / tau) sigmoid(tau (r - 1)) A, tau = sapo_temperature_pos if A > 0 else _neg: a soft gate with
    gradient r at r = 1 that fades smoothly off-policy instead of cutting off."""
    temperature = _choose(t.advantages > 0, t.sapo_temperature_pos, t.sapo_temperature_neg, t.ratio)
    return -torch.sigmoid(temperature * (t.ratio - 1)) * 4 / temperature * t.advantages, {}


def vespo_term(t: TokenTerms) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """VESPO: -phi(w) A log pi with phi from `vespo_weights` (the sampler correction enters phi). Stats:
    "vespo_phi" [B, 1]."""
    phi = vespo_weights(t.token_log_ratio, t.advantages, t.valid, t.vespo, t.sampler_ratio)
    return -phi * t.advantages * t.logps, {"vespo_phi": phi}


@dataclass(frozen=True)
class PolicyLoss:
    """One policy loss type: its per-token term, how `aggregate_loss` reduces it, and what else depends on it."""

    term: Callable[[TokenTerms], tuple[torch.Tensor, dict[str, torch.Tensor]]]
    aggregation: str  # one of AGGREGATIONS
    summary: str  # the config's help text for it
    clips: bool = False  # its term is the PPO clip of the ratio (epsilon bounds it; clip stats)
    # Whether it sums the token terms over the optimizer step, so that with importance_sampling_level="sequence"
    # each sequence weighs by its length (TRL's list for its warning, kept as TRL has it).
    sums_tokens: bool = False
    corrects_sampler: bool = True  # its term is multiplied by the sampler ratio (vespo folds it into its weight)
    every_trainer: bool = False  # an aggregation of the clipped surrogate that every online trainer accepts


# How aggregate_loss reduces a per-token loss; its docstring gives the formulas.
AGGREGATIONS = ("grpo", "bnpo", "dr_grpo", "dapo", "luspo")
# Every policy loss type, in TRL's order. A new type is one entry here (and a test of its numbers).
POLICY_LOSSES: dict[str, PolicyLoss] = {
    "grpo": PolicyLoss(
        clipped_term, "grpo", "mean per completion, then over completions", clips=True, every_trainer=True
    ),
    "bnpo": PolicyLoss(
        clipped_term, "bnpo", "token mean of the micro-batch", clips=True, sums_tokens=True, every_trainer=True
    ),
    "dr_grpo": PolicyLoss(
        clipped_term,
        "dr_grpo",
        "token sum / (completions x max_completion_length)",
        clips=True,
        sums_tokens=True,
        every_trainer=True,
    ),
    "dapo": PolicyLoss(
        clipped_term, "dapo", "token mean of the optimizer step", clips=True, sums_tokens=True, every_trainer=True
    ),
    "cispo": PolicyLoss(
        cispo_term,
        "dapo",
        "clipped, detached ratio times log-prob; epsilon_high is its cap, ~5; dapo aggregation",
        sums_tokens=True,
    ),
    "sapo": PolicyLoss(sapo_term, "grpo", "soft sigmoid gate instead of the clip; grpo aggregation"),
    "luspo": PolicyLoss(
        clipped_term,
        "luspo",
        "token sum / completions; use importance_sampling_level='sequence'",
        clips=True,
    ),
    "vespo": PolicyLoss(
        vespo_term,
        "dapo",
        "smooth gamma weight of the sequence ratio; dapo aggregation",
        corrects_sampler=False,
    ),
}
GRPO_LOSS_TYPES = tuple(POLICY_LOSSES)
# The aggregations of the clipped surrogate every online trainer accepts (RLOO, PPO; GRPO takes them all).
LOSS_TYPES = tuple(name for name, loss in POLICY_LOSSES.items() if loss.every_trainer)


def loss_type_help(names: tuple[str, ...] = GRPO_LOSS_TYPES) -> str:
    """The config's help text for a loss_type accepting `names`, from the registry."""
    clipped = [name for name in names if POLICY_LOSSES[name].clips]
    others = [name for name in names if not POLICY_LOSSES[name].clips]
    kinds = f"the clipped surrogate with an aggregation ({', '.join(clipped)})"
    if others:
        kinds += f" or another per-token term ({', '.join(others)})"
    described = "; ".join(f"{name}: {POLICY_LOSSES[name].summary}" for name in names)
    return f"One of {names}: {kinds}. {described}."


def policy_objective(
    logps: torch.Tensor,
    old_logps: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    loss_type: str = "grpo",
    epsilon_low: float = 0.2,
    epsilon_high: float | None = None,
    delta: float | None = None,
    importance_sampling_level: str = "token",
    sapo_temperature_pos: float = 1.0,
    sapo_temperature_neg: float = 1.05,
    vespo: VespoParams = VespoParams(),
    keep: torch.Tensor | None = None,
    sampler_ratio: torch.Tensor | None = None,
    ref_logps: torch.Tensor | None = None,
    beta: float = 0.0,
    kl_bias_correction: bool = False,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Per-token policy loss [B, T] of a loss type of POLICY_LOSSES (its term's docstring gives it), and its stats.

    r = exp(logps - old_logps) per token, or with importance_sampling_level="sequence" (GSPO, Zheng et al.
    2025) the sequence's mean log ratio over its valid tokens, shared by its tokens; "sequence_token" (GSPO-token,
    the same paper) has the sequence ratio's value on every token but each token's own gradient,
    r_t = sg(r_seq) * pi(y_t) / sg(pi(y_t)), so per-token advantages can weight tokens differently.
    `advantages` is [B] or [B, T]. The policy term is multiplied by `keep` (0/1 token or sequence selection:
    high-entropy tokens, off-policy masking) and, where the type `corrects_sampler`, by `sampler_ratio` (the
    sampler-mismatch importance weight, [B, T] or [B, 1]). Then beta * k3 KL to `ref_logps` is added, times r
    itself (not detached) when `kl_bias_correction` (DeepSeek-V3.2: makes the KL gradient that of the true reverse
    KL off-policy).

    Stats (detached): the term's own, and "kl" (mean of the KL term before beta, when ref_logps is given).
    """
    epsilon_high = epsilon_low if epsilon_high is None else epsilon_high
    _check_objective_settings(loss_type, epsilon_low, epsilon_high, importance_sampling_level, beta, ref_logps)
    # Zero the padding first, so that whatever it holds (even -inf) cannot reach a value or a gradient.
    valid = mask.bool()
    weights = valid.to(logps.dtype)
    logps = torch.where(valid, logps, 0.0)
    token_log_ratio = logps - torch.where(valid, old_logps.detach(), 0.0)
    ratio = torch.exp(_log_ratio(token_log_ratio, logps, weights, importance_sampling_level))  # [B, T] or [B, 1]
    advantages = (advantages.unsqueeze(1) if advantages.dim() == 1 else advantages).detach()  # [B, 1] or [B, T]
    options = (epsilon_low, epsilon_high, delta, sapo_temperature_pos, sapo_temperature_neg, vespo)
    terms = TokenTerms(ratio, advantages, logps, token_log_ratio, valid, weights, sampler_ratio, *options)
    loss, stats = POLICY_LOSSES[loss_type].term(terms)
    if keep is not None:
        loss = loss * keep.to(loss.dtype)
    if sampler_ratio is not None and POLICY_LOSSES[loss_type].corrects_sampler:
        loss = loss * sampler_ratio.detach().to(loss.dtype)
    loss = loss.expand_as(logps)

    if ref_logps is not None:
        kl = kl_k3(logps, torch.where(valid, ref_logps.detach(), 0.0))
        if kl_bias_correction:
            kl = kl * ratio
        if beta > 0:
            loss = loss + beta * kl
        stats["kl"] = masked_mean(kl.detach(), weights)
    return torch.where(valid, loss, 0.0), stats


def _log_ratio(token_log_ratio, logps, weights, importance_sampling_level: str) -> torch.Tensor:
    """The log importance ratio at `importance_sampling_level`: per token [B, T], or the sequence's mean [B, 1]
    (GSPO), or that mean's value on every token with each token's own gradient (GSPO-token)."""
    if importance_sampling_level == "token":
        return token_log_ratio
    log_ratio = token_log_ratio.sum(dim=1, keepdim=True) / weights.sum(dim=1, keepdim=True).clamp(min=1)
    if importance_sampling_level == "sequence_token":
        return log_ratio.detach() + logps - logps.detach()
    return log_ratio


def _check_loss_type(loss_type: str) -> None:
    if loss_type not in POLICY_LOSSES:
        raise ConfigError(f"loss_type={loss_type!r} is not one of {GRPO_LOSS_TYPES}; pick one of them.")


def _check_objective_settings(loss_type, epsilon_low, epsilon_high, importance_sampling_level, beta, ref_logps):
    _check_loss_type(loss_type)
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


def _fraction(flags: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Mean of 0/1 `flags` over valid tokens ([B, T]) or over sequences ([B, 1], sequence-level ratios)."""
    flags = flags.to(weights.dtype)
    return flags.mean() if flags.shape[1] == 1 else masked_mean(flags, weights)


def clip_stats(low: torch.Tensor, high: torch.Tensor, weights: torch.Tensor) -> dict[str, torch.Tensor]:
    """The clip statistics of a clipped objective, from the flags of the tokens (or sequences, [B, 1]) whose
    gradient the clip removes below (`low`) and above (`high`): the fractions over the valid tokens, and per
    sequence. `policy_objective`'s docstring lists the keys; GMPO reports the same."""

    def per_sequence(flags):
        flags = flags.to(weights.dtype)
        if flags.shape[1] == 1:
            return flags.squeeze(1)
        return (flags * weights).sum(dim=1) / weights.sum(dim=1)  # NaN for a row without tokens, as TRL

    return {
        "clip_ratio_low": _fraction(low, weights),
        "clip_ratio_high": _fraction(high, weights),
        "clip_ratio": _fraction(low | high, weights),
        "clip_ratio_low_per_sequence": per_sequence(low),
        "clip_ratio_high_per_sequence": per_sequence(high),
    }


def objective_metrics(stats: dict[str, torch.Tensor], gather=lambda values: values) -> dict[str, torch.Tensor]:
    """`policy_objective`'s stats under TRL's metric keys. `gather` collects per-sequence values from every
    process for the extremes: clip_ratio/low_min and /high_max are the smallest and largest per-sequence clipped
    fractions (sequences without tokens left out)."""
    metrics = {}
    if "clip_ratio" in stats:
        low, high = gather(stats["clip_ratio_low_per_sequence"]), gather(stats["clip_ratio_high_per_sequence"])
        metrics.update(
            {
                "clip_ratio/low_mean": stats["clip_ratio_low"],
                "clip_ratio/high_mean": stats["clip_ratio_high"],
                "clip_ratio/region_mean": stats["clip_ratio"],
                "clip_ratio/low_min": low.nan_to_num(1.0).min(),
                "clip_ratio/high_max": high.nan_to_num(0.0).max(),
            }
        )
    if "cispo_clip_ratio" in stats:
        metrics["cispo_clip_ratio"] = stats["cispo_clip_ratio"]
    if "vespo_phi" in stats:
        metrics["vespo/phi_seq_mean"] = stats["vespo_phi"].mean()
    if "kl" in stats:
        metrics["kl"] = stats["kl"]
    return metrics


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
    delta: float | None = None,
    kl_bias_correction: bool = False,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO/GRPO clipped surrogate per token: -min(r * A, clip(r, 1 - eps_low, 1 + eps_high) * A) [+ beta * k3].

    `policy_objective` with the clip family; see there for r, the sequence level (GSPO), `delta`, the KL term
    and the stats. epsilon_high defaults to epsilon_low; a larger one lets low-probability tokens grow (DAPO
    "clip-higher").
    """
    return policy_objective(
        logps,
        old_logps,
        advantages,
        mask,
        loss_type="grpo",
        epsilon_low=epsilon_low,
        epsilon_high=epsilon_high,
        delta=delta,
        importance_sampling_level=importance_sampling_level,
        ref_logps=ref_logps,
        beta=beta,
        kl_bias_correction=kl_bias_correction,
    )


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
    - "luspo":   sum_it l_it m_it / total_sequences   (each sequence's loss scaled by its length, LUSPO)
    Every loss type names its aggregation in POLICY_LOSSES ("sapo" like "grpo"; "cispo" and "vespo" like "dapo").

    total_sequences and total_tokens default to this batch's own counts (B and sum m). Gradient
    accumulation and data parallelism must not change the gradient, so the engine passes the counts
    of the *whole optimizer step* (all accumulation micro-batches, all processes): each call then
    returns its micro-batch's share, and the shares sum to the full-batch loss. That makes every type
    split-invariant given the global counts: grpo and dr_grpo through total_sequences, bnpo and dapo
    through total_tokens. "bnpo" with its default (local token count) is the one that is not: it
    normalises each micro-batch separately. "dapo" insists on the global count, which is its definition.
    The caller undoes the Trainer's division by accumulation steps and DDP's mean over processes.
    """
    _check_loss_type(loss_type)
    named, loss_type = loss_type, POLICY_LOSSES[loss_type].aggregation
    weights = mask.to(per_token_loss.dtype)
    masked = per_token_loss * weights
    if total_sequences is None:
        total_sequences = per_token_loss.shape[0]
    if loss_type == "grpo":
        per_sequence = masked.sum(dim=1) / weights.sum(dim=1).clamp(min=1)
        return per_sequence.sum() / total_sequences
    if loss_type == "luspo":
        return masked.sum() / total_sequences
    if loss_type == "dr_grpo":
        if max_completion_length is None:
            raise ConfigError("loss_type='dr_grpo' normalises by max_completion_length: pass it.")
        return masked.sum() / (total_sequences * max_completion_length)
    if total_tokens is None:
        if loss_type == "dapo":
            raise ConfigError(
                f"loss_type={named!r} normalises by the number of completion tokens in the whole optimizer-step "
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


def entropy_from_logits(logits: torch.Tensor, chunk_size: int | None = None) -> torch.Tensor:
    """Entropy of the softmax over the last dimension, [..., V] -> [...], in the logits' dtype.

    Computed from log_softmax, so large logits do not overflow; logits of -inf (banned tokens) contribute
    0 and keep the gradient finite. `chunk_size` rows at a time (of the flattened leading dimensions) bounds the
    [rows, V] temporaries; the values are the same.
    """
    if chunk_size is not None and logits.dim() > 1:
        flat = logits.reshape(-1, logits.shape[-1])
        parts = [entropy_from_logits(part) for part in flat.split(chunk_size)]
        return torch.cat(parts).reshape(logits.shape[:-1])
    logps = torch.log_softmax(logits, dim=-1)
    finite_logps = logps.masked_fill(torch.isneginf(logps), 0.0)
    return -(logps.exp() * finite_logps).sum(dim=-1)
