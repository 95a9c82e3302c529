"""TRL's `trl.experimental.online_dpo.online_dpo_config` path: OnlineDPOConfig."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from posttrain.online.paired_preference import PairedPreferenceConfig


@dataclass
class OnlineDPOConfig(PairedPreferenceConfig):
    """OnlineConfig with online DPO's settings and TRL's defaults (2 completions per prompt, beta 0.1,
    temperature 0.9, 64 new tokens, learning rate 5e-7, loss_type 'sigmoid' or 'ipo')."""

    method: ClassVar[str] = "Online DPO"


__all__ = ["OnlineDPOConfig"]
