"""`trl.experimental.kto`: KTO before its promotion to the stable API. `KTOConfig` and `KTOTrainer` here are the
stable `posttrain.KTOConfig` / `posttrain.KTOTrainer` with a FutureWarning naming the stable import."""

from __future__ import annotations

from posttrain.experimental.kto.kto_config import KTOConfig
from posttrain.trainers.kto import KTOTrainer as _KTOTrainer
from posttrain.training.moved import moved_trainer_init


class KTOTrainer(_KTOTrainer):
    __init__ = moved_trainer_init(_KTOTrainer, "kto")


__all__ = ["KTOConfig", "KTOTrainer"]
