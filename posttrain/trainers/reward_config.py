"""`RewardConfig`: the settings of reward modelling, with TRL's field names, order, defaults and help."""

from __future__ import annotations

from dataclasses import dataclass

from posttrain.errors import ConfigError
from posttrain.training.base import PosttrainConfig
from posttrain.training.fields import option
from posttrain.training.reference_trainer import resolve_pad_to_multiple_of


@dataclass
class RewardConfig(PosttrainConfig):
    learning_rate: float = option(1e-4, "Peak learning rate.")
    disable_dropout: bool = option(True, "Turn dropout off in the model.")
    eos_token: str | None = option(
        None,
        "Token to use as EOS (appended to standard-format completions); must be in the vocabulary (default: "
        "the tokenizer's).",
    )
    pad_token: str | None = option(None, "Token to pad with (default: the tokenizer's pad token, else its EOS).")
    chat_template_path: str | None = option(
        None,
        "A .jinja chat template file, or a tokenizer (directory or id) whose chat template (and added tokens) "
        "to clone.",
    )
    max_length: int | None = option(
        1024, "Rows where prompt + chosen or prompt + rejected is longer are dropped (None keeps all)."
    )
    pad_to_multiple_of: int | str | None = option(
        "auto", "Pad each batch to a multiple of this length ('auto': no extra padding off Neuron)."
    )
    center_rewards_coefficient: float | None = option(
        None,
        "Weight of the penalty mean((r_chosen + r_rejected)^2) that keeps rewards centred on zero (Eisenstein "
        "et al. 2023 use 0.01).",
    )

    def __post_init__(self):
        self.pad_to_multiple_of = resolve_pad_to_multiple_of(self.pad_to_multiple_of)
        if self.max_length is not None and self.max_length < 1:
            raise ConfigError(f"max_length={self.max_length} must be at least 1 (or None for no limit).")
        super().__post_init__()
