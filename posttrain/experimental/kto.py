"""`trl.experimental.kto`: KTO before its promotion to the stable API. `KTOConfig` and `KTOTrainer` here are the
stable `posttrain.KTOConfig` / `posttrain.KTOTrainer` with a FutureWarning naming the stable import."""

from __future__ import annotations

from dataclasses import dataclass

from posttrain.experimental._moved import moved_trainer_init, warn_moved
from posttrain.trainers.kto import KTOConfig as _KTOConfig
from posttrain.trainers.kto import KTOTrainer as _KTOTrainer


@dataclass
class KTOConfig(_KTOConfig):
    def __post_init__(self):
        warn_moved("KTOConfig", "kto", stacklevel=4)
        super().__post_init__()


class KTOTrainer(_KTOTrainer):
    __init__ = moved_trainer_init(_KTOTrainer, "kto")


__all__ = ["KTOConfig", "KTOTrainer"]
