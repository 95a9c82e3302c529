"""`trl.experimental.distillation`: distillation before its promotion to the stable API. `DistillationConfig` and
`DistillationTrainer` here are the stable `posttrain.DistillationConfig` / `posttrain.DistillationTrainer` with a
FutureWarning naming the stable import."""

from __future__ import annotations

from posttrain.experimental.distillation.distillation_config import DistillationConfig
from posttrain.trainers.distillation import DistillationTrainer as _DistillationTrainer
from posttrain.training.moved import moved_trainer_init


class DistillationTrainer(_DistillationTrainer):
    __init__ = moved_trainer_init(_DistillationTrainer, "distillation")


__all__ = ["DistillationConfig", "DistillationTrainer"]
