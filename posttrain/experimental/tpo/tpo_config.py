"""TRL's `trl.experimental.tpo.tpo_config` path: TPOConfig."""

from __future__ import annotations

from dataclasses import dataclass

from posttrain.errors import ConfigError
from posttrain.losses.tpo import SMOOTHABLE, TPO_LOSS_TYPES
from posttrain.training.base import PosttrainConfig
from posttrain.training.fields import (
    config_field,
    disable_dropout_field,
    learning_rate_field,
    max_length_field,
    pad_to_multiple_of_field,
    remove_unused_columns_field,
    truncation_mode_field,
)


@dataclass
class TPOConfig(PosttrainConfig):
    remove_unused_columns: bool = remove_unused_columns_field()  # TRL's default
    learning_rate: float = learning_rate_field(5e-7)
    remove_unused_columns: bool = config_field(
        True, "Drop the dataset columns the collator does not read (TRL's default; the result is the same either way)."
    )
    disable_dropout: bool = disable_dropout_field(
        True, "Turn dropout off in the model (its log-probs are compared across completions)."
    )
    max_length: int | None = max_length_field(
        1024, "Bound on each prompt + completion sequence, cut as truncation_mode says (None: no bound)."
    )
    truncation_mode: str = truncation_mode_field()
    pad_to_multiple_of: int | None = pad_to_multiple_of_field(None, "Pad each batch to a multiple of this length.")
    loss_type: str = config_field(
        "sigmoid",
        "Preference loss between chosen and rejected: sigmoid (TPO), hinge (SLiC), ipo, or tpo-l "
        "(length-normalised, with a target margin).",
        choices=TPO_LOSS_TYPES,
    )
    beta: float = config_field(0.01, "Temperature of the preference loss (for 'ipo', its regulariser tau).", gt=0)
    label_smoothing: float = config_field(
        0.0, "Assumed rate of flipped preference labels, in [0, 0.5] ('sigmoid' and 'tpo-l' only).", min=0, max=0.5
    )
    tpo_alpha: float = config_field(
        1.0,
        "Weight of the NLL of the gold `reference` completion (0: no NLL term, and the gold completions are "
        "not run through the model).",
        min=0,
    )
    tpo_l_gamma: float = config_field(0.5, "Target reward margin gamma of loss_type 'tpo-l'.")

    def __post_init__(self):
        if self.label_smoothing and self.loss_type not in SMOOTHABLE:
            raise ConfigError(
                f"label_smoothing={self.label_smoothing} has no effect on loss_type "
                f"{self.loss_type!r} (only {sorted(SMOOTHABLE)} use it); set label_smoothing=0.0."
            )
        super().__post_init__()
