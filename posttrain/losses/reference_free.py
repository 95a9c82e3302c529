"""Reference-free preference losses: ORPO (Hong et al. 2024) and CPO (Xu et al. 2024) with the SimPO (Meng et al.
2024) and AlphaPO (Gupta et al. 2025) variants. No reference model: the policy's own log-probabilities of the
chosen and rejected completions are compared directly, and a negative log-likelihood term on the chosen
completions (added by the trainer) keeps the policy a good language model.

Pure functions: per-pair sequence log-probs in, per-pair losses and rewards out (unreduced, so the trainer divides
their sum by the number of pairs in the whole effective batch).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

from posttrain.errors import ConfigError

CPO_LOSS_TYPES = ("sigmoid", "hinge", "ipo", "simpo", "alphapo")
# Loss types that compare per-token average log-probs (length-normalised); the others take the sums.
CPO_AVERAGED_TYPES = frozenset({"ipo", "simpo"})
CPO_LABEL_SMOOTHING_TYPES = frozenset({"sigmoid", "simpo"})


def log1mexp(x: Tensor) -> Tensor:
    """log(1 - exp(x)) for x < 0 without cancellation: log1p(-exp(x)) far from 0, log(-expm1(x)) near it
    (switching at x = -log 2, Maechler 2012)."""
    return torch.where(x < -math.log(2), torch.log1p(-torch.exp(x)), torch.log(-torch.expm1(x)))


def orpo_loss(chosen_logps: Tensor, rejected_logps: Tensor, beta: float = 0.1):
    """ORPO's odds-ratio term (paper's Eq. 7, weight lambda = `beta`) from per-token average log-probs.

    odds(y) = p / (1 - p) with p = exp(average log-prob), so
    log odds(y_w) - log odds(y_l) = (l_w - l_r) - (log(1 - e^l_w) - log(1 - e^l_r)).
    Returns per pair: the loss -beta * log sigmoid(log-odds ratio), chosen and rejected rewards (beta * average
    log-prob, detached), log sigmoid(log-odds ratio) and the log-odds ratio itself (both detached, for logging).
    """
    # float32 at least: 1 - e^l cancels badly in half precision
    chosen_logps, rejected_logps = (
        x.float() if x.dtype in (torch.float16, torch.bfloat16) else x for x in (chosen_logps, rejected_logps)
    )
    log_odds = (chosen_logps - rejected_logps) - (log1mexp(chosen_logps) - log1mexp(rejected_logps))
    log_sigmoid_odds = F.logsigmoid(log_odds)
    return (
        -beta * log_sigmoid_odds,
        beta * chosen_logps.detach(),
        beta * rejected_logps.detach(),
        log_sigmoid_odds.detach(),
        log_odds.detach(),
    )


def alphapo_reward(logps: Tensor, alpha: float) -> Tensor:
    """AlphaPO's reward shape r = (1 - p^-alpha) / alpha with p = exp(logps); alpha -> 0 gives log p back."""
    if alpha == 0.0:
        return logps
    return (1 - torch.exp(-alpha * logps)) / alpha


def validate_cpo_settings(loss_type: str, beta: float, label_smoothing: float, cpo_alpha: float) -> None:
    """Rejects CPO settings that cannot mean what the user intends (called when the config is built)."""
    if loss_type not in CPO_LOSS_TYPES:
        raise ConfigError(f"loss_type={loss_type!r} is not a CPO loss; choose from {list(CPO_LOSS_TYPES)}.")
    if beta <= 0:
        raise ConfigError(
            f"beta={beta} must be positive (it scales the reward difference; simpo and ipo divide by it)."
        )
    if not 0.0 <= label_smoothing <= 0.5:
        raise ConfigError(
            f"label_smoothing={label_smoothing} must lie in [0, 0.5] (it is the rate of flipped preference labels)."
        )
    if label_smoothing > 0 and loss_type not in CPO_LABEL_SMOOTHING_TYPES | {"alphapo"}:
        raise ConfigError(
            f"label_smoothing={label_smoothing} has no effect on loss_type={loss_type!r}; set it to 0 "
            f"or use one of {sorted(CPO_LABEL_SMOOTHING_TYPES)}."
        )
    if cpo_alpha < 0:
        raise ConfigError(f"cpo_alpha={cpo_alpha} must be at least 0 (it weights the chosen completions' NLL).")


def cpo_loss(
    chosen_logps: Tensor,
    rejected_logps: Tensor,
    loss_type: str = "sigmoid",
    beta: float = 0.1,
    label_smoothing: float = 0.0,
    simpo_gamma: float = 0.5,
    alpha: float = 0.0,
):
    """CPO's preference term per pair (the NLL term is the trainer's), on sequence log-probs: sums for sigmoid and
    hinge, per-token averages for ipo and simpo (the caller passes the right ones, see CPO_AVERAGED_TYPES).

    With h = r(y_w) - r(y_l) and r the log-prob (or AlphaPO's shape when `alpha` != 0):
      sigmoid: -(1 - eps) log sigmoid(beta h) - eps log sigmoid(-beta h)        (CPO Eq. 3, cDPO smoothing)
      simpo:   the same with h - gamma / beta                                   (SimPO's target margin gamma)
      hinge:   max(0, 1 - beta h)                                               (SLiC)
      ipo:     (h - 1 / (2 beta))^2                                             (IPO Eq. 17, beta = tau)
    Returns per pair: losses, chosen rewards and rejected rewards (beta * r, detached).
    """
    chosen_rewards, rejected_rewards = alphapo_reward(chosen_logps, alpha), alphapo_reward(rejected_logps, alpha)
    margin = chosen_rewards - rejected_rewards
    if loss_type in ("simpo", "alphapo"):
        margin = margin - simpo_gamma / beta
    if loss_type in ("sigmoid", "simpo", "alphapo"):
        losses = -(1 - label_smoothing) * F.logsigmoid(beta * margin) - label_smoothing * F.logsigmoid(-beta * margin)
    elif loss_type == "hinge":
        losses = torch.relu(1 - beta * margin)
    elif loss_type == "ipo":
        losses = (margin - 1 / (2 * beta)) ** 2
    else:
        raise ConfigError(f"loss_type={loss_type!r} is not a CPO loss; choose from {list(CPO_LOSS_TYPES)}.")
    return losses, beta * chosen_rewards.detach(), beta * rejected_rewards.detach()
