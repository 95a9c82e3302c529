"""Online preference losses: online DPO, XPO and Nash-MD, on pairs of sampled completions.

Every function takes summed (or per-token) completion log-probs and returns per-pair or per-completion values;
the trainer reduces them. Formulas:

- Online DPO (Guo et al. 2024, arXiv:2402.04792): the DPO loss on the pair ranked by the reward/judge,
  sigmoid: -log sigmoid(beta * h), ipo: (h - 1 / (2 beta))^2, with
  h = (log pi(y+) - log pi_ref(y+)) - (log pi(y-) - log pi_ref(y-)).
- XPO (Xie et al. 2024, arXiv:2405.21046, Algorithm 1): the same DPO loss plus the exploration term
  alpha * log pi(y_ref), y_ref sampled from the reference model (minimising it moves probability away from what
  the reference already covers).
- Nash-MD (Munos et al. 2023, arXiv:2312.00886): for y ~ pi and y' ~ the geometric mixture
  pi_mix ∝ pi^(1-c) pi_ref^c, with P = P(y beats y'), the REINFORCE surrogate
  beta * sum_t sg(log pi(y_t) - log pi_ref(y_t)) log pi(y_t) - (P - 1/2) * sum_t log pi(y_t),
  whose gradient is beta * grad KL(pi || pi_ref) - (P - 1/2) * grad log pi(y) (1/2 is the control variate).
"""

from __future__ import annotations

import torch
from torch import Tensor

from posttrain.losses.preference import dpo_loss

__all__ = ["geometric_mixture_logps", "nash_md_loss", "online_dpo_loss", "pair_preferences", "xpo_loss"]


def pair_preferences(scores: Tensor) -> Tensor:
    """[P, 2] scores of each prompt's two completions -> [P] bool, True where the first is chosen (ties go to the
    first, as TRL ranks them)."""
    return scores[:, 0] >= scores[:, 1]


def online_dpo_loss(
    chosen_logps: Tensor,
    rejected_logps: Tensor,
    ref_chosen_logps: Tensor,
    ref_rejected_logps: Tensor,
    beta: float,
    loss_type: str = "sigmoid",
) -> tuple[Tensor, Tensor, Tensor]:
    """Per-pair losses [P] and the detached implicit rewards beta * (log pi - log pi_ref) of chosen and rejected.

    Log-probs are summed over each completion (IPO here takes the sums as they are, as online DPO does)."""
    if loss_type not in ("sigmoid", "ipo"):
        raise ValueError(f"loss_type={loss_type!r}: online DPO implements 'sigmoid' and 'ipo'.")
    return dpo_loss(chosen_logps, rejected_logps, ref_chosen_logps, ref_rejected_logps, loss_type=loss_type, beta=beta)


def xpo_loss(
    chosen_logps: Tensor,
    rejected_logps: Tensor,
    ref_chosen_logps: Tensor,
    ref_rejected_logps: Tensor,
    policy_logps_of_ref_samples: Tensor,
    beta: float,
    alpha: float,
    loss_type: str = "sigmoid",
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Per-pair XPO loss [P] = DPO loss + alpha * log pi(y_ref); also returns the DPO part, the exploration part
    and the (detached) chosen - rejected implicit reward margin."""
    dpo, chosen_rewards, rejected_rewards = online_dpo_loss(
        chosen_logps, rejected_logps, ref_chosen_logps, ref_rejected_logps, beta, loss_type
    )
    exploration = alpha * policy_logps_of_ref_samples
    return dpo + exploration, dpo, exploration, chosen_rewards - rejected_rewards


def nash_md_loss(
    logps: Tensor, ref_logps: Tensor, mask: Tensor, probability: Tensor, beta: float
) -> tuple[Tensor, Tensor, Tensor]:
    """Per-completion Nash-MD surrogate [N] for the policy's own samples, with its score term
    (P - 1/2) * log pi(y) and its KL estimate sum_t (log pi - log pi_ref) (detached).

    `logps`, `ref_logps`, `mask` are [N, T] per-token values of the policy's completions; `probability` [N] is the
    probability that each beats its mixture completion."""
    mask = mask.to(logps.dtype)
    sequence_logps = (logps * mask).sum(1)
    score = (probability.to(logps.dtype) - 0.5) * sequence_logps
    log_ratio = (logps.detach() - ref_logps) * mask
    kl_surrogate = (log_ratio * logps).sum(1)  # its gradient is the REINFORCE estimate of grad KL(pi || pi_ref)
    return beta * kl_surrogate - score, score.detach(), log_ratio.sum(1)


def geometric_mixture_logps(policy_logits: Tensor, ref_logits: Tensor, mixture_coef: float) -> Tensor:
    """Next-token log-probs of the geometric mixture pi^(1-c) * pi_ref^c, normalised (Nash-MD's pi_mix, formed
    from the logits as TRL did: log_softmax(c * ref_logits + (1 - c) * policy_logits))."""
    return torch.log_softmax(mixture_coef * ref_logits + (1 - mixture_coef) * policy_logits, dim=-1)
