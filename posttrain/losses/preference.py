"""Preference losses: the reward model's Bradley-Terry loss, the DPO family and KTO.

All functions are pure: sequence log-probabilities in, per-example losses out. Sequence log-probs are the
sum of token log-probs over the completion (IPO callers pass the per-token average instead, see `dpo_loss`).
The DPO and KTO functions return per-example losses unreduced so the trainer can divide their sum by the
global number of examples, which keeps gradient accumulation and multi-process runs equivalent to one big batch.
Token-level helpers (LD-DPO's length-desensitised sums, WPO's weights) turn per-token log-probs into the
per-sequence numbers the losses take.
"""

import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from posttrain.errors import ConfigError, DataError
from posttrain.losses.dpo_types import DPO_LOSS_TYPES, DPO_LOSSES, PairScores
from posttrain.losses.reductions import masked_mean

F_DIVERGENCE_TYPES = ("reverse_kl", "forward_kl", "js_divergence", "alpha_divergence")
KTO_LOSS_TYPES = ("kto", "apo_zero_unpaired")
# Loss types whose formula has a label-noise rate; the others do not read `label_smoothing`.
LABEL_SMOOTHING_TYPES = frozenset({"sigmoid", "robust", "exo_pair", "aot", "aot_unpaired"})
# The f-divergence generalisation (Wang et al. 2023) leaves a beta * log Z(x) term that cancels only in the
# chosen-minus-rejected score difference, so only the losses built on that difference take it (as in TRL).
F_DIVERGENCE_LOSS_TYPES = frozenset(
    {"sigmoid", "sigmoid_norm", "hinge", "ipo", "exo_pair", "robust", "discopop", "sft"}
)
# Loss types that compare length-normalised scores: they need the completion lengths.
LENGTH_NORMALISED_TYPES = frozenset({"ipo", "sigmoid_norm"})
# Losses that sort over the batch: a per-pair weight would land on the wrong quantile.
SORTING_TYPES = frozenset({"aot", "aot_unpaired"})


def bradley_terry_loss(
    chosen_rewards: Tensor,
    rejected_rewards: Tensor,
    margin: Tensor | float | None = None,
    center_rewards_coefficient: float | None = None,
) -> Tensor:
    """Reward-model loss: mean of -log sigmoid(r_c - r_r - margin), optionally plus a centering penalty.

    The penalty coef * mean((r_c + r_r)^2) (Eisenstein et al. 2023, "Helping or Herding?") pins the
    reward scale's free offset near zero, since Bradley-Terry only sees reward differences.
    """
    differences = chosen_rewards - rejected_rewards
    if margin is not None:
        differences = differences - margin
    loss = -F.logsigmoid(differences).mean()
    if center_rewards_coefficient:
        loss = loss + center_rewards_coefficient * ((chosen_rewards + rejected_rewards) ** 2).mean()
    return loss


def validate_dpo_loss_settings(
    loss_type: str | Sequence[str] = "sigmoid",
    loss_weights: Sequence[float] | None = None,
    *,
    beta: float = 0.1,
    label_smoothing: float = 0.0,
    f_divergence_type: str = "reverse_kl",
    f_alpha_divergence_coef: float = 0.5,
    discopop_tau: float = 0.05,
    use_weighting: bool = False,
    ld_alpha: float | None = None,
) -> tuple[tuple[str, ...], tuple[float, ...]]:
    """Check DPO loss settings (a config can call this before training) and return (types, weights)."""
    loss_types = (loss_type,) if isinstance(loss_type, str) else tuple(loss_type)
    unknown = [name for name in loss_types if name not in DPO_LOSS_TYPES]
    if not loss_types or unknown:
        raise ConfigError(
            f"loss_type {unknown or list(loss_types)} is not supported; choose from {list(DPO_LOSS_TYPES)}."
        )
    if len(set(loss_types)) != len(loss_types):
        raise ConfigError(
            f"loss_type {list(loss_types)} names a type twice; list each type once and weight it with loss_weights."
        )
    weights = tuple(float(w) for w in loss_weights) if loss_weights is not None else (1.0,) * len(loss_types)
    if len(weights) != len(loss_types):
        raise ConfigError(
            f"loss_weights has {len(weights)} entries but loss_type has {len(loss_types)}; "
            "give one weight per loss type."
        )
    if beta <= 0:
        raise ConfigError(f"beta={beta} must be positive (it scales the implicit reward).")
    if not 0.0 <= label_smoothing <= 0.5:
        raise ConfigError(
            f"label_smoothing={label_smoothing} must lie in [0, 0.5] (it is the rate of flipped preference labels)."
        )
    if label_smoothing > 0 and not LABEL_SMOOTHING_TYPES.intersection(loss_types):
        raise ConfigError(
            f"label_smoothing={label_smoothing} has no effect on loss_type {list(loss_types)}; "
            f"set it to 0 or use one of {sorted(LABEL_SMOOTHING_TYPES)}."
        )
    if "robust" in loss_types and label_smoothing == 0.5:
        raise ConfigError("loss_type 'robust' divides by 1 - 2 * label_smoothing; set label_smoothing below 0.5.")
    if "exo_pair" in loss_types and label_smoothing == 0:
        raise ConfigError(
            "loss_type 'exo_pair' takes log(label_smoothing); set label_smoothing > 0 (the EXO paper uses 1e-3)."
        )
    if f_divergence_type not in F_DIVERGENCE_TYPES:
        raise ConfigError(
            f"f_divergence_type={f_divergence_type!r} is not supported; choose from {list(F_DIVERGENCE_TYPES)}."
        )
    if f_divergence_type != "reverse_kl" and not F_DIVERGENCE_LOSS_TYPES.issuperset(loss_types):
        raise ConfigError(
            f"f_divergence_type={f_divergence_type!r} only applies to loss types built on the chosen-minus-rejected "
            f"score difference {sorted(F_DIVERGENCE_LOSS_TYPES)}, but loss_type is {list(loss_types)}; drop the "
            "others or set f_divergence_type='reverse_kl'."
        )
    if not math.isfinite(f_alpha_divergence_coef):
        raise ConfigError(f"f_alpha_divergence_coef={f_alpha_divergence_coef} must be a finite number.")
    if use_weighting and SORTING_TYPES.intersection(loss_types):
        raise ConfigError(
            f"use_weighting=True weights each pair, but loss_type {sorted(SORTING_TYPES.intersection(loss_types))} "
            "sorts the batch, so a pair's weight would land on another pair's loss; set use_weighting=False or use "
            "another loss type."
        )
    if ld_alpha is not None and not 0.0 <= ld_alpha <= 1.0:
        raise ConfigError(
            f"ld_alpha={ld_alpha} must lie in [0, 1] (1 = no down-weighting, 0 = ignore the tokens "
            "past the shorter completion's length), or be None."
        )
    if "discopop" in loss_types and discopop_tau <= 0:
        raise ConfigError(f"discopop_tau={discopop_tau} must be positive (the paper uses 0.05).")
    return loss_types, weights


def f_divergence_scores(logratios: Tensor, f_divergence_type: str, alpha: float = 0.5) -> Tensor:
    """f'(u) at u = pi/pi_ref (given as log u): the score whose chosen-minus-rejected difference is the DPO logit
    under an f-divergence (Wang et al. 2023, Table 1). The additive constants follow TRL, which matters for the
    length-normalised losses (ipo, sigmoid_norm), where they no longer cancel.

    alpha_divergence uses f'(u) = (u^(alpha-1) - 1) / (alpha - 1), TRL's parameterisation (it tends to log u, the
    reverse KL, as alpha -> 1; the paper's alpha is 1 - this alpha, and the two agree at alpha = 0.5).
    """
    if f_divergence_type == "reverse_kl":  # f'(u) = log u
        return logratios
    if f_divergence_type == "forward_kl":  # f'(u) = 1 - 1/u
        return 1 - torch.exp(-logratios)
    if f_divergence_type == "js_divergence":  # f'(u) = log(2u / (1 + u))
        return math.log(2) + F.logsigmoid(logratios)
    if abs(alpha - 1.0) < 1e-6:  # the limit alpha -> 1 is the reverse KL
        return logratios
    exponent = (alpha - 1.0) * logratios
    if exponent.dtype in (torch.float16, torch.bfloat16):
        exponent = exponent.float()
    exponent = exponent.clamp(max=80.0)  # keeps exp() finite in float32, as TRL does
    return ((torch.exp(exponent) - 1.0) / (alpha - 1.0)).to(logratios.dtype)


def dpo_loss(
    chosen_logps: Tensor,
    rejected_logps: Tensor,
    ref_chosen_logps: Tensor,
    ref_rejected_logps: Tensor,
    *,
    loss_type: str | Sequence[str] = "sigmoid",
    loss_weights: Sequence[float] | None = None,
    beta: float = 0.1,
    label_smoothing: float = 0.0,
    f_divergence_type: str = "reverse_kl",
    f_alpha_divergence_coef: float = 0.5,
    chosen_nll: Tensor | None = None,
    bco_delta: Tensor | float = 0.0,
    discopop_tau: float = 0.05,
    chosen_lengths: Tensor | None = None,
    rejected_lengths: Tensor | None = None,
    pair_weights: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """Per-example DPO-family losses [B], chosen rewards [B] and rejected rewards [B] (rewards detached).

    Rewards are beta * (policy - reference) log-probs. `loss_type` is one type or a list of types; the loss
    is then sum_k loss_weights[k] * loss_k per example (weights default to 1). 'ipo' and 'sigmoid_norm' divide
    each f-divergence score by its completion length (`chosen_lengths`, `rejected_lengths`, token counts); without
    lengths, 'ipo' takes the log-probs as given (pass length-averaged ones). 'bco_pair' subtracts `bco_delta`
    (0 in TRL). 'sft' returns `chosen_nll` [B]. `pair_weights` [B] (WPO, see `wpo_weights`) multiplies every
    pair's loss. 'aot' and 'aot_unpaired' sort over the batch, so their i-th loss belongs to the i-th quantile,
    not to example i. The caller reduces the batch. Each type's formula is its function in `dpo_types.DPO_LOSSES`.
    """
    loss_types, weights = validate_dpo_loss_settings(
        loss_type,
        loss_weights,
        beta=beta,
        label_smoothing=label_smoothing,
        f_divergence_type=f_divergence_type,
        f_alpha_divergence_coef=f_alpha_divergence_coef,
        discopop_tau=discopop_tau,
    )
    _check_loss_inputs(loss_types, chosen_logps, chosen_nll, chosen_lengths, rejected_lengths)
    chosen_logratios = chosen_logps - ref_chosen_logps
    rejected_logratios = rejected_logps - ref_rejected_logps
    # h = (pi_c - pi_r) - (ref_c - ref_r), or its f-divergence counterpart f'(u_c) - f'(u_r).
    chosen_scores = f_divergence_scores(chosen_logratios, f_divergence_type, f_alpha_divergence_coef)
    rejected_scores = f_divergence_scores(rejected_logratios, f_divergence_type, f_alpha_divergence_coef)
    logits = chosen_scores - rejected_scores
    if chosen_lengths is not None and rejected_lengths is not None:
        normalised = chosen_scores / chosen_lengths.to(chosen_scores.dtype).clamp(
            min=1
        ) - rejected_scores / rejected_lengths.to(rejected_scores.dtype).clamp(min=1)
    else:
        normalised = logits
    scores = PairScores(
        chosen_logps,
        rejected_logps,
        ref_chosen_logps,
        ref_rejected_logps,
        chosen_logratios,
        rejected_logratios,
        logits,
        normalised,
        chosen_nll,
        beta,
        label_smoothing,
        bco_delta,
        discopop_tau,
    )
    total = torch.zeros_like(chosen_logratios)
    for name, weight in zip(loss_types, weights):
        total = total + weight * DPO_LOSSES[name](scores)
    if pair_weights is not None:
        total = total * pair_weights.detach()

    chosen_rewards = beta * chosen_logratios.detach()
    rejected_rewards = beta * rejected_logratios.detach()
    return total, chosen_rewards, rejected_rewards


def _check_loss_inputs(loss_types, chosen_logps, chosen_nll, chosen_lengths, rejected_lengths) -> None:
    """What the loss types read besides the log-probs was passed to `dpo_loss`."""
    if "sft" in loss_types and chosen_nll is None:
        raise ConfigError(
            "loss_type 'sft' needs chosen_nll, the per-example NLL of the chosen completion; pass it to dpo_loss."
        )
    if "sigmoid_norm" in loss_types and (chosen_lengths is None or rejected_lengths is None):
        raise ConfigError(
            "loss_type 'sigmoid_norm' needs chosen_lengths and rejected_lengths (completion token "
            "counts); pass both to dpo_loss."
        )
    if chosen_nll is not None and chosen_nll.shape != chosen_logps.shape:
        raise DataError(
            f"chosen_nll has shape {tuple(chosen_nll.shape)} but chosen_logps has {tuple(chosen_logps.shape)}; "
            "pass one NLL per example."
        )


def length_desensitized_logps(token_logps: Tensor, mask: Tensor, shared_lengths: Tensor, ld_alpha: float) -> Tensor:
    """LD-DPO (Liu et al. 2024): per-sequence log-probs [N] where completion tokens past the pair's shared length
    count with weight `ld_alpha` (the first `shared_lengths[i]` completion tokens of sequence i count fully).

    `token_logps` and `mask` are [N, T] (mask 1 on completion tokens); `shared_lengths` [N] is min(|y_w|, |y_l|)
    of the pair each sequence belongs to. ld_alpha = 1 gives the plain sum.
    """
    position = mask.cumsum(-1)  # 1-based position among the completion tokens
    shared = mask.bool() & (position <= shared_lengths[:, None])
    tail = mask.bool() & (position > shared_lengths[:, None])
    return (token_logps * shared).sum(-1) + ld_alpha * (token_logps * tail).sum(-1)


def wpo_weights(token_logps: Tensor, token_log_sum_sq_probs: Tensor, mask: Tensor) -> Tensor:
    """WPO (Zhou et al. 2024, Eq. 2 with the aligned probabilities of Sec. 3.2): per-sequence weights [N],
    exp(mean over completion tokens of log p(y_t) - log sum_v p(v)^2), detached.

    `token_log_sum_sq_probs` [N, T] is log sum_v p(v | prefix)^2 at each position; a pair's weight is the product
    of its chosen and rejected sequences' weights.
    """
    mask = mask.to(token_logps.dtype)
    aligned = masked_mean(token_logps - token_log_sum_sq_probs, mask, dim=-1)
    return torch.exp(aligned).detach()


def dpo_metrics(chosen_rewards: Tensor, rejected_rewards: Tensor) -> dict[str, Tensor]:
    """Batch means of the implicit rewards, how often chosen beats rejected, and the reward margin (0-dim tensors on
    the rewards' device: no host sync)."""
    return {
        "rewards/chosen": chosen_rewards.detach().mean(),
        "rewards/rejected": rejected_rewards.detach().mean(),
        "rewards/accuracies": (chosen_rewards > rejected_rewards).float().mean(),
        "rewards/margins": (chosen_rewards - rejected_rewards).detach().mean(),
    }


def kto_loss(
    policy_logps: Tensor,
    ref_logps: Tensor,
    labels: Tensor,
    policy_kl_logps: Tensor | None,
    ref_kl_logps: Tensor | None,
    *,
    beta: float = 0.1,
    desirable_weight: float = 1.0,
    undesirable_weight: float = 1.0,
    loss_type: str = "kto",
) -> tuple[Tensor, Tensor, Tensor]:
    """Per-example weighted KTO losses [B], rewards beta * log(pi/pi_ref) [B] (detached), and the KL point z0.

    KTO (Ethayarajh et al. 2024): z0 = max(0, mean(log pi/pi_ref)) over mismatched prompt/completion pairs,
    detached; desirable examples lose w_d * (1 - sig(beta (r - z0))), undesirable ones
    w_u * (1 - sig(beta (z0 - r))). 'apo_zero_unpaired' (D'Oosterlinck et al. 2024) drops z0: desirable
    1 - sig(beta r), undesirable sig(beta r). z0 is zero when the KL log-probs are not given (allowed only
    for 'apo_zero_unpaired'). The caller sums the losses and divides by the (global) number of examples.
    """
    if loss_type not in KTO_LOSS_TYPES:
        raise ConfigError(f"loss_type={loss_type!r} is not supported for KTO; choose from {list(KTO_LOSS_TYPES)}.")
    if labels.dtype != torch.bool:
        raise DataError(
            f"KTO labels must be a bool tensor (True = desirable), got dtype {labels.dtype}; "
            "convert the 'label' column to bool."
        )
    if (policy_kl_logps is None) != (ref_kl_logps is None):
        raise ConfigError("pass both policy_kl_logps and ref_kl_logps, or neither.")
    if policy_kl_logps is None:
        if loss_type == "kto":
            raise ConfigError(
                "loss_type 'kto' needs policy_kl_logps and ref_kl_logps (log-probs of mismatched "
                "prompt/completion pairs) for its KL reference point; pass both."
            )
        kl = torch.zeros((), dtype=policy_logps.dtype, device=policy_logps.device)
    else:
        kl = (policy_kl_logps - ref_kl_logps).mean().clamp(min=0).detach()

    logratios = policy_logps - ref_logps
    if loss_type == "kto":
        desirable = 1 - torch.sigmoid(beta * (logratios - kl))
        undesirable = 1 - torch.sigmoid(beta * (kl - logratios))
    else:
        desirable = 1 - torch.sigmoid(beta * logratios)
        undesirable = torch.sigmoid(beta * logratios)
    losses = torch.where(labels, desirable_weight * desirable, undesirable_weight * undesirable)
    return losses, beta * logratios.detach(), kl
