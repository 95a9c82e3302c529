"""NashMDConfig: the settings of the nash_md trainer, at TRL's `trl.experimental.nash_md.nash_md_config` path."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from posttrain.online.paired_preference import (
    PairedPreferenceConfig,
)
from posttrain.training.fields import config_field


@dataclass
class NashMDConfig(PairedPreferenceConfig):
    """Online DPO's settings plus `mixture_coef`."""

    method: ClassVar[str] = "Nash-MD"
    schedules: ClassVar[tuple[str, ...]] = (*PairedPreferenceConfig.schedules, "mixture_coef")

    mixture_coef: list[float] | float = config_field(
        help="Weight of the reference in the geometric mixture pi^(1-c) pi_ref^c that samples the opponent "
        "completion, in [0, 1]. A list gives one value per epoch.",
        default_factory=lambda: [0.5],
        min=0,
        max=1,
    )
