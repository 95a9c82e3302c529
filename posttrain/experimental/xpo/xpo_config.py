"""XPOConfig: the settings of the xpo trainer, at TRL's `trl.experimental.xpo.xpo_config` path."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from posttrain.online.paired_preference import (
    PairedPreferenceConfig,
)
from posttrain.training.fields import config_field


@dataclass
class XPOConfig(PairedPreferenceConfig):
    """Online DPO's settings plus `alpha`."""

    method: ClassVar[str] = "XPO"
    schedules: ClassVar[tuple[str, ...]] = (*PairedPreferenceConfig.schedules, "alpha")

    alpha: list[float] | float = config_field(
        help="Weight of the exploration term alpha * log pi(y_ref) (>= 0). A list gives one value per epoch.",
        default_factory=lambda: [1e-5],
        min=0,
    )
