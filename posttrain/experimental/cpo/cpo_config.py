"""CPOConfig: the settings of the cpo trainer, at TRL's `trl.experimental.cpo.cpo_config` path."""

from __future__ import annotations

from dataclasses import dataclass

from posttrain.losses.reference_free import CPO_LOSS_TYPES, validate_cpo_settings
from posttrain.training.fields import config_field
from posttrain.training.reference_free import ReferenceFreeConfig


@dataclass
class CPOConfig(ReferenceFreeConfig):
    remove_unused_columns: bool = config_field(
        True, "Drop the dataset columns the collator does not read (TRL's default; the result is the same either way)."
    )
    beta: float = config_field(0.1, "Temperature of the preference loss (for ipo, the regularisation tau).", gt=0)
    label_smoothing: float = config_field(
        0.0, "Assumed rate of flipped preference labels, in [0, 0.5] (sigmoid and simpo only).", min=0, max=0.5
    )
    loss_type: str = config_field(
        "sigmoid",
        "sigmoid (CPO), hinge (SLiC), ipo, simpo (SimPO), or alphapo (SimPO with cpo_alpha=0; set alpha for "
        "AlphaPO's reward shape).",
        choices=CPO_LOSS_TYPES,
    )
    cpo_alpha: float = config_field(1.0, "Weight of the NLL (behaviour cloning) term on the chosen completions.")
    simpo_gamma: float = config_field(0.5, "SimPO's target reward margin gamma (simpo only).")
    alpha: float = config_field(
        0.0, "AlphaPO's reward shape, any loss type: r = (1 - p^-alpha) / alpha (0: r = log p)."
    )

    def __post_init__(self):
        if self.loss_type == "alphapo":  # as TRL: shorthand for SimPO without the NLL term
            self.loss_type, self.cpo_alpha = "simpo", 0.0
        validate_cpo_settings(self.loss_type, self.beta, self.label_smoothing, self.cpo_alpha)
        super().__post_init__()
