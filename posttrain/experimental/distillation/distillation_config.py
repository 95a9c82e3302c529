"""DistillationConfig: the settings of the distillation trainer, at TRL's
`trl.experimental.distillation.distillation_config` path."""

from __future__ import annotations

from dataclasses import dataclass

from posttrain.trainers.distillation import DistillationConfig as _DistillationConfig
from posttrain.training.moved import warn_moved


@dataclass
class DistillationConfig(_DistillationConfig):
    def __post_init__(self):
        warn_moved("DistillationConfig", "distillation", stacklevel=4)
        super().__post_init__()
