"""ORPOConfig: the settings of the orpo trainer, at TRL's `trl.experimental.orpo.orpo_config` path."""

from __future__ import annotations

from dataclasses import dataclass

from posttrain.training.fields import config_field
from posttrain.training.reference_free import ReferenceFreeConfig


@dataclass
class ORPOConfig(ReferenceFreeConfig):
    remove_unused_columns: bool = config_field(
        True, "Drop the dataset columns the collator does not read (TRL's default; the result is the same either way)."
    )
    beta: float = config_field(0.1, "Weight of the odds-ratio term against the NLL term (the paper's lambda).")
    padding_value: int | None = config_field(None, "Token id padding input_ids (default: the tokenizer's pad token).")
