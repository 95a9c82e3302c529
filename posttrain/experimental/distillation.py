"""`trl.experimental.distillation`: distillation before its promotion to the stable API. `DistillationConfig` and
`DistillationTrainer` here are the stable `posttrain.DistillationConfig` / `posttrain.DistillationTrainer` with a
FutureWarning naming the stable import."""

from __future__ import annotations

from dataclasses import dataclass

from posttrain.experimental._moved import moved_trainer_init, warn_moved
from posttrain.trainers.distillation import DistillationConfig as _DistillationConfig
from posttrain.trainers.distillation import DistillationTrainer as _DistillationTrainer


@dataclass
class DistillationConfig(_DistillationConfig):
    def __post_init__(self):
        warn_moved("DistillationConfig", "distillation", stacklevel=4)
        super().__post_init__()


class DistillationTrainer(_DistillationTrainer):
    __init__ = moved_trainer_init(_DistillationTrainer, "distillation")


__all__ = ["DistillationConfig", "DistillationTrainer"]
