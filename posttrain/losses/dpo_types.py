"""The DPO family's loss types: one pure function per type, from the batch's `PairScores` to the per-pair loss [B],
and `DPO_LOSSES`, the table `posttrain.losses.preference.dpo_loss` looks them up in. A new loss type is a function
here and a row of the table (plus, where it applies, a place in preference.py's sets of types that read label
smoothing, the f-divergence or the completion lengths).

In the formulas, r_c and r_r are beta * log(pi / pi_ref) of the chosen and the rejected completion, h the
chosen-minus-rejected score difference (f-divergence scores, `f_divergence_scores`), e the label smoothing and
logsig the log-sigmoid.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor


class PairScores(NamedTuple):
    """What the loss types are computed from, for B (chosen, rejected) pairs."""

    chosen_logps: Tensor  # [B] policy log-probs of the chosen completions
    rejected_logps: Tensor  # [B] and of the rejected ones
    ref_chosen_logps: Tensor  # [B] the reference's
    ref_rejected_logps: Tensor  # [B]
    chosen_logratios: Tensor  # [B] log(pi / pi_ref) of the chosen completions
    rejected_logratios: Tensor  # [B] and of the rejected ones
    logits: Tensor  # [B] h, the chosen-minus-rejected score difference
    normalised: Tensor  # [B] h from length-normalised scores (h itself without the lengths)
    chosen_nll: Tensor | None  # [B] NLL of the chosen completions, for 'sft'
    beta: float
    label_smoothing: float
    bco_delta: Tensor | float
    discopop_tau: float


def _smoothed_logistic(z: Tensor, label_smoothing: float) -> Tensor:
    """Logistic loss on z when a fraction `label_smoothing` of the labels is flipped (cDPO)."""
    return -(1 - label_smoothing) * F.logsigmoid(z) - label_smoothing * F.logsigmoid(-z)


def sigmoid_loss(s: PairScores) -> Tensor:
    """DPO, Rafailov et al. 2023 Eq. 7: -logsig(beta h); cDPO label smoothing (Mitchell 2023)."""
    return _smoothed_logistic(s.beta * s.logits, s.label_smoothing)


def hinge_loss(s: PairScores) -> Tensor:
    """SLiC-HF calibration loss, Zhao et al. 2023: max(0, 1 - beta h)."""
    return torch.relu(1 - s.beta * s.logits)


def ipo_loss(s: PairScores) -> Tensor:
    """IPO, Azar et al. 2023 Eq. 17: (h - 1/(2 beta))^2, on length-normalised scores when lengths are given."""
    return (s.normalised - 1 / (2 * s.beta)) ** 2


def robust_loss(s: PairScores) -> Tensor:
    """rDPO, Chowdhury et al. 2024: ((1 - e) l(beta h) - e l(-beta h)) / (1 - 2e), l = -logsig."""
    eps, beta = s.label_smoothing, s.beta
    return (-(1 - eps) * F.logsigmoid(beta * s.logits) + eps * F.logsigmoid(-beta * s.logits)) / (1 - 2 * eps)


def exo_pair_loss(s: PairScores) -> Tensor:
    """EXO-pref, Ji et al. 2024 Eq. 16: KL(softmax(beta logratios) || (1 - e, e))."""
    eps, beta = s.label_smoothing, s.beta
    p_chosen = torch.sigmoid(beta * s.logits)
    return p_chosen * (F.logsigmoid(beta * s.logits) - math.log(1 - eps)) + (1 - p_chosen) * (
        F.logsigmoid(-beta * s.logits) - math.log(eps)
    )


def nca_pair_loss(s: PairScores) -> Tensor:
    """NCA, Chen et al. 2024: -logsig(r_c) - 1/2 (logsig(-r_c) + logsig(-r_r))."""
    beta = s.beta
    return -F.logsigmoid(beta * s.chosen_logratios) - 0.5 * (
        F.logsigmoid(-beta * s.chosen_logratios) + F.logsigmoid(-beta * s.rejected_logratios)
    )


def bco_pair_loss(s: PairScores) -> Tensor:
    """BCO, Jung et al. 2024: -logsig(r_c - delta) - logsig(-(r_r - delta)), delta = `bco_delta` (0 in TRL)."""
    return -F.logsigmoid(s.beta * s.chosen_logratios - s.bco_delta) - F.logsigmoid(
        -(s.beta * s.rejected_logratios - s.bco_delta)
    )


def sppo_hard_loss(s: PairScores) -> Tensor:
    """SPPO, Wu et al. 2024 Eq. 4.7, hard labels P = 1 / 0, eta = 1 / beta."""
    return (s.chosen_logratios - 1 / (2 * s.beta)) ** 2 + (s.rejected_logratios + 1 / (2 * s.beta)) ** 2


def aot_loss(s: PairScores) -> Tensor:
    """AOT paired, Melnyk et al. 2024: the sorted policy margins dominate the sorted reference margins."""
    policy_margins = torch.sort(s.chosen_logps - s.rejected_logps).values
    delta = policy_margins - torch.sort(s.ref_chosen_logps - s.ref_rejected_logps).values
    return _smoothed_logistic(s.beta * delta, s.label_smoothing)


def aot_unpaired_loss(s: PairScores) -> Tensor:
    """AOT unpaired, Melnyk et al. 2024: the sorted chosen log-ratios dominate the sorted rejected ones."""
    delta = torch.sort(s.chosen_logratios).values - torch.sort(s.rejected_logratios).values
    return _smoothed_logistic(s.beta * delta, s.label_smoothing)


def apo_zero_loss(s: PairScores) -> Tensor:
    """APO-zero, D'Oosterlinck et al. 2024 Eq. 7: 1 - sig(r_c) + sig(r_r)."""
    return 1 - torch.sigmoid(s.beta * s.chosen_logratios) + torch.sigmoid(s.beta * s.rejected_logratios)


def apo_down_loss(s: PairScores) -> Tensor:
    """APO-down, D'Oosterlinck et al. 2024 Eq. 8: sig(r_c) + 1 - sig(r_c - r_r)."""
    margins = s.chosen_logratios - s.rejected_logratios
    return torch.sigmoid(s.beta * s.chosen_logratios) + 1 - torch.sigmoid(s.beta * margins)


def discopop_loss(s: PairScores) -> Tensor:
    """DiscoPOP (LRML), Lu et al. 2024 Eq. 5: the logistic and exponential losses mixed by sig(beta h / tau)."""
    beta = s.beta
    modulation = torch.sigmoid(beta * s.logits / s.discopop_tau)
    return (1 - modulation) * -F.logsigmoid(beta * s.logits) + modulation * torch.exp(-beta * s.logits)


def sft_loss(s: PairScores) -> Tensor:
    """The NLL of the chosen completion (an RPO-style auxiliary term when combined with another type)."""
    return s.chosen_nll


def sigmoid_norm_loss(s: PairScores) -> Tensor:
    """DPO on length-normalised scores (as TRL defines it): -logsig(beta h_normalised)."""
    return -F.logsigmoid(s.beta * s.normalised)


# In TRL's order of the types. The functions write a product such as beta * h out at each use rather than share
# it: a shared one would sum its uses' gradients before multiplying by beta, which rounds differently.
DPO_LOSSES: dict[str, Callable[[PairScores], Tensor]] = {
    "sigmoid": sigmoid_loss,
    "hinge": hinge_loss,
    "ipo": ipo_loss,
    "robust": robust_loss,
    "exo_pair": exo_pair_loss,
    "nca_pair": nca_pair_loss,
    "bco_pair": bco_pair_loss,
    "sppo_hard": sppo_hard_loss,
    "aot": aot_loss,
    "aot_unpaired": aot_unpaired_loss,
    "apo_zero": apo_zero_loss,
    "apo_down": apo_down_loss,
    "discopop": discopop_loss,
    "sft": sft_loss,
    "sigmoid_norm": sigmoid_norm_loss,
}
DPO_LOSS_TYPES = tuple(DPO_LOSSES)
