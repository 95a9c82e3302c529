"""KTOConfig: the settings of the kto trainer, at TRL's `trl.experimental.kto.kto_config` path."""

from __future__ import annotations

from dataclasses import dataclass

from posttrain.trainers.kto import KTOConfig as _KTOConfig
from posttrain.training.moved import warn_moved


@dataclass
class KTOConfig(_KTOConfig):
    def __post_init__(self):
        warn_moved("KTOConfig", "kto", stacklevel=4)
        super().__post_init__()
