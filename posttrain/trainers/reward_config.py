"""`RewardConfig`: the settings of reward modelling, with TRL's field names, order, defaults and help."""

from __future__ import annotations

from dataclasses import dataclass

from posttrain.training.base import PosttrainConfig
from posttrain.training.fields import (
    config_field,
    disable_dropout_field,
    learning_rate_field,
    max_length_field,
    pad_to_multiple_of_field,
    parse_pad_to_multiple_of,
    remove_unused_columns_field,
)


@dataclass
class RewardConfig(PosttrainConfig):
    """Settings of `RewardTrainer`: TRL's reward-modelling fields and defaults on top of transformers'
    `TrainingArguments`.

    See docs/trainers/reward.md.
    """

    remove_unused_columns: bool = remove_unused_columns_field()  # TRL's default

    learning_rate: float = learning_rate_field(1e-4)
    disable_dropout: bool = disable_dropout_field(True)
    eos_token: str | None = config_field(
        None,
        "Token to use as EOS (appended to standard-format completions); must be in the vocabulary (default: "
        "the tokenizer's).",
    )
    pad_token: str | None = config_field(None, "Token to pad with (default: the tokenizer's pad token, else its EOS).")
    chat_template_path: str | None = config_field(
        None,
        "A .jinja chat template file, or a tokenizer (directory or id) whose chat template (and added tokens) "
        "to clone.",
    )
    max_length: int | None = max_length_field(
        1024, "Rows where prompt + chosen or prompt + rejected is longer are dropped (None keeps all)."
    )
    pad_to_multiple_of: int | str | None = pad_to_multiple_of_field()
    center_rewards_coefficient: float | None = config_field(
        None,
        "Weight of the penalty mean((r_chosen + r_rejected)^2) that keeps rewards centred on zero (Eisenstein "
        "et al. 2023 use 0.01).",
    )

    def __post_init__(self):
        self.pad_to_multiple_of = parse_pad_to_multiple_of(self.pad_to_multiple_of)
        super().__post_init__()
