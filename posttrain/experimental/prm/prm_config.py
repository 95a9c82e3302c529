"""PRMConfig: the settings of the prm trainer, at TRL's `trl.experimental.prm.prm_config` path."""

from __future__ import annotations

from dataclasses import dataclass

from posttrain.errors import ConfigError
from posttrain.training.base import PosttrainConfig
from posttrain.training.fields import (
    config_field,
    disable_dropout_field,
    learning_rate_field,
    max_completion_length_field,
    max_length_field,
    max_prompt_length_field,
)


@dataclass
class PRMConfig(PosttrainConfig):
    learning_rate: float = learning_rate_field(1e-5)
    max_length: int | None = max_length_field(1024, "Cut prompt + steps to this many tokens (None: no limit).")
    max_prompt_length: int | None = max_prompt_length_field(
        512, "Keep the last this many prompt tokens (a BOS token is kept in front; None: no limit)."
    )
    max_completion_length: int | None = max_completion_length_field(
        None, "Cut the steps (all of them together) to this many tokens (None: no limit)."
    )
    disable_dropout: bool = disable_dropout_field(True)
    step_separator: str = config_field("\n", "Text appended to every step; a step's label sits on its last token.")
    train_on_last_step_only: bool = config_field(
        False, "Train on the last step's label only (evaluation still scores every step)."
    )

    def __post_init__(self):
        if not self.step_separator:
            raise ConfigError("step_separator='' gives steps no token to carry their label; use e.g. '\\n'.")
        super().__post_init__()
