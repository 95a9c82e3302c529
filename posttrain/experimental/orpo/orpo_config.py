"""ORPOConfig: the settings of the orpo trainer, at TRL's `trl.experimental.orpo.orpo_config` path."""

from __future__ import annotations

from dataclasses import dataclass

from posttrain.training.fields import config_field
from posttrain.training.reference_free import ReferenceFreeConfig


@dataclass
class ORPOConfig(ReferenceFreeConfig):
    beta: float = config_field(0.1, "Weight of the odds-ratio term against the NLL term (the paper's lambda).")
    padding_value: int | None = config_field(None, "Token id padding input_ids (default: the tokenizer's pad token).")
