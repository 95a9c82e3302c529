"""BCOConfig: the settings of the bco trainer, at TRL's `trl.experimental.bco.bco_config` path."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from posttrain.errors import ConfigError
from posttrain.training.fields import (
    config_field,
    max_completion_length_field,
    max_length_field,
    max_prompt_length_field,
    remove_unused_columns_field,
    truncation_mode_field,
)
from posttrain.training.reference_trainer import (
    ReferenceConfig,
    check_length_settings,
)


@dataclass
class BCOConfig(ReferenceConfig):
    # TRL's BCOConfig keeps TrainingArguments' True (its documented command passes --no_remove_unused_columns); the
    # trainer names its collator's columns, so only the dataset's other columns go
    remove_unused_columns: bool = remove_unused_columns_field()
    learning_rate: float = config_field(5e-5, "Peak learning rate (TRL's BCOConfig kept transformers' default).")
    train_sampling_strategy: str = config_field(
        "sequential", "Order of the training rows (TRL's BCO reads them in order)."
    )
    max_length: int | None = max_length_field(
        1024, "Bound on prompt + completion (None: no bound); see max_prompt_length."
    )
    max_prompt_length: int | None = max_prompt_length_field(
        None,
        "When prompt + completion exceeds max_length: first cut the prompt to this many tokens (as "
        "truncation_mode says), then the completion to max_length - max_prompt_length. None: cut the whole "
        "sequence as truncation_mode says.",
    )
    max_completion_length: int | None = max_completion_length_field(
        None, "Keep at most the first this-many completion tokens."
    )
    beta: float = config_field(
        0.1,
        "Scale of the implicit reward beta * log(pi/pi_ref); higher keeps the policy closer to the reference.",
        gt=0,
    )
    label_pad_token_id: int = config_field(
        -100,
        "TRL's marker of untrained label positions; posttrain marks completion tokens with a mask instead, so "
        "any value trains the same.",
    )
    padding_value: int | None = config_field(None, "Token id that pads input_ids (default: the tokenizer's pad token).")
    truncation_mode: str = truncation_mode_field(
        "keep_end", "Which end of an over-long prompt (or sequence) survives: keep_end or keep_start."
    )
    generate_during_eval: bool = config_field(
        False, "Not supported (TRL logged sampled completions to W&B / Comet tables)."
    )
    is_encoder_decoder: bool | None = config_field(
        None, "Only decoder-only (causal) models are supported: leave unset or False."
    )
    ref_model_init_kwargs: dict | str | None = config_field(
        None, "Keyword arguments for from_pretrained when `ref_model` is a name or path."
    )
    prompt_sample_size: int = config_field(
        1024, "UDM: prompts of each class embedded to fit the density-ratio classifier.", min=1
    )
    min_density_ratio: float = config_field(0.5, "UDM: lower clamp of an undesirable example's density-ratio weight.")
    max_density_ratio: float = config_field(10.0, "UDM: upper clamp of an undesirable example's density-ratio weight.")

    unsupported_options: ClassVar[dict[str, str]] = {
        **ReferenceConfig.unsupported_options,
        "generate_during_eval": "it logged sampled completions as W&B / Comet tables; posttrain logs completions "
        "with posttrain.callbacks.LogCompletionsCallback instead.",
    }

    def __post_init__(self):
        if isinstance(self.ref_model_init_kwargs, str):
            import json

            self.ref_model_init_kwargs = json.loads(self.ref_model_init_kwargs)
        if self.is_encoder_decoder:
            raise ConfigError(
                "is_encoder_decoder=True: posttrain's BCOTrainer trains decoder-only (causal) models; "
                "leave is_encoder_decoder unset."
            )
        check_length_settings(self)
        if not 0 <= self.min_density_ratio <= self.max_density_ratio:
            raise ConfigError(
                f"min_density_ratio={self.min_density_ratio} and max_density_ratio="
                f"{self.max_density_ratio} must satisfy 0 <= min <= max."
            )
        super().__post_init__()
