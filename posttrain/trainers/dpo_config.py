"""`DPOConfig`: the settings of DPO and its loss family, with TRL's field names, order, defaults and help."""

from __future__ import annotations

from dataclasses import dataclass

from posttrain.losses.preference import DPO_LOSS_TYPES, F_DIVERGENCE_TYPES, validate_dpo_loss_settings
from posttrain.training.fields import (
    config_field,
    max_completion_length_field,
    max_length_field,
    max_prompt_length_field,
    remove_unused_columns_field,
    truncation_mode_field,
)
from posttrain.training.reference_trainer import ReferenceConfig, check_length_settings
from posttrain.training.vision import freeze_vision_tower_field


@dataclass
class DPOConfig(ReferenceConfig):
    """Settings of `DPOTrainer`: TRL's DPO fields and defaults (loss types, beta, reference handling, lengths) on top
    of transformers' `TrainingArguments`.

    See docs/trainers/dpo.md.
    """

    remove_unused_columns: bool = remove_unused_columns_field()  # TRL's default

    beta: float = config_field(
        0.1, "Strength of the pull towards the reference: rewards are beta * log(pi / pi_ref).", gt=0
    )
    loss_type: list[str] = config_field(
        help="DPO loss, or several to sum (a list, or comma-separated names): sigmoid, hinge, ipo, robust, "
        "exo_pair, nca_pair, bco_pair, sppo_hard, aot, aot_unpaired, apo_zero, apo_down, discopop, sft, "
        "sigmoid_norm.",
        default_factory=lambda: ["sigmoid"],
        choices=DPO_LOSS_TYPES,
    )
    loss_weights: list[float] | None = config_field(None, "One weight per loss_type entry (default: 1 each).")
    ld_alpha: float | None = config_field(
        None,
        "LD-DPO: weight in [0, 1] of the completion tokens past the shorter completion's length (None or 1: "
        "plain sums).",
        min=0,
        max=1,
    )
    use_weighting: bool = config_field(
        False, "WPO: weight each pair by the policy's length-normalised probabilities of its two completions."
    )
    label_smoothing: float = config_field(
        0.0, "Assumed rate of flipped preference labels (cDPO / robust / EXO), in [0, 0.5].", min=0, max=0.5
    )
    f_divergence_type: str = config_field(
        "reverse_kl",
        "Divergence to the reference: reverse_kl (DPO), forward_kl, js_divergence or alpha_divergence.",
        choices=F_DIVERGENCE_TYPES,
    )
    f_alpha_divergence_coef: float = config_field(
        0.5, "alpha of the alpha divergence, f'(u) = (u^(alpha-1) - 1) / (alpha - 1)."
    )
    discopop_tau: float = config_field(0.05, "Temperature of the discopop loss.")
    max_length: int | None = max_length_field(
        1024, "Bound on each prompt + completion sequence, cut as truncation_mode says."
    )
    truncation_mode: str = truncation_mode_field()
    max_prompt_length: int | None = max_prompt_length_field(
        None, "posttrain extra: keep at most the last this-many prompt tokens."
    )
    max_completion_length: int | None = max_completion_length_field(
        None, "posttrain extra: keep at most the first this-many tokens of each completion."
    )
    padding_free: bool = config_field(False, "Concatenate each batch's 2B sequences into one row without padding.")
    pad_token: str | None = config_field(
        None, "Deprecated in TRL: the padding token (default: the tokenizer's, else EOS)."
    )
    freeze_vision_tower: bool = freeze_vision_tower_field()

    def __post_init__(self):
        # Comma-separated names (the command line's form) -> a list.
        entries = [self.loss_type] if isinstance(self.loss_type, str) else list(self.loss_type)
        self.loss_type = [name.strip() for entry in entries for name in entry.split(",")]
        validate_dpo_loss_settings(
            self.loss_type,
            self.loss_weights,
            beta=self.beta,
            label_smoothing=self.label_smoothing,
            f_divergence_type=self.f_divergence_type,
            f_alpha_divergence_coef=self.f_alpha_divergence_coef,
            discopop_tau=self.discopop_tau,
            use_weighting=self.use_weighting,
            ld_alpha=self.ld_alpha,
        )
        check_length_settings(self)
        super().__post_init__()
