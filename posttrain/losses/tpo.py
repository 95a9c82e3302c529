"""Triple Preference Optimization (Saeidi et al. 2024, arXiv:2405.16681): a preference term between the chosen and
the rejected completion, with no reference model, plus a supervised term on a third, gold completion.

With s = the policy's log-probability of a completion (summed over its tokens; the token mean for 'ipo' and
'tpo-l', SimPO's length-normalised score) and d = s_chosen - s_rejected, the per-pair preference losses are
    sigmoid: -(1 - eps) log sigma(beta d) - eps log sigma(-beta d)            (eps: label_smoothing)
    hinge:   max(0, 1 - beta d)                                                (SLiC)
    ipo:     (d - 1 / (2 beta))^2                                              (IPO; beta is its tau)
    tpo-l:   sigmoid loss of d - gamma / beta                                  (TPO-L: a target margin gamma)
and the implicit rewards are beta * s. The gold term (alpha * its token-mean NLL) is added by the trainer.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

TPO_LOSS_TYPES = ("sigmoid", "hinge", "ipo", "tpo-l")
LENGTH_NORMALISED = frozenset({"ipo", "tpo-l"})  # scores are per-token means, not sums
SMOOTHABLE = frozenset({"sigmoid", "tpo-l"})  # the types label_smoothing applies to


def tpo_loss(
    chosen_scores: Tensor,
    rejected_scores: Tensor,
    *,
    loss_type: str = "sigmoid",
    beta: float = 0.01,
    label_smoothing: float = 0.0,
    tpo_l_gamma: float = 0.5,
) -> tuple[Tensor, Tensor, Tensor]:
    """Per-pair preference losses [B], chosen rewards [B] and rejected rewards [B] (rewards detached).

    `*_scores` are the policy's completion log-probs, already length-normalised for the types in
    LENGTH_NORMALISED (see `tpo_scores`)."""
    if loss_type not in TPO_LOSS_TYPES:
        raise ValueError(f"loss_type={loss_type!r}; choose from {list(TPO_LOSS_TYPES)}.")
    diff = chosen_scores - rejected_scores
    if loss_type == "tpo-l":
        diff = diff - tpo_l_gamma / beta
    if loss_type in SMOOTHABLE:
        losses = -(1 - label_smoothing) * F.logsigmoid(beta * diff) - label_smoothing * F.logsigmoid(-beta * diff)
    elif loss_type == "hinge":
        losses = torch.relu(1 - beta * diff)
    else:  # ipo
        losses = (diff - 1 / (2 * beta)) ** 2
    return losses, beta * chosen_scores.detach(), beta * rejected_scores.detach()


def tpo_scores(logps: Tensor, token_counts: Tensor, loss_type: str) -> Tensor:
    """Summed completion log-probs -> the scores `tpo_loss` compares (token means for 'ipo' and 'tpo-l')."""
    if loss_type in LENGTH_NORMALISED:
        return logps / token_counts.clamp(min=1)
    return logps
