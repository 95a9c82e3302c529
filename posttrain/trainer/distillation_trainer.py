"""TRL's `trl.trainer.distillation_trainer` import path; the trainer lives in `posttrain.trainers.distillation`."""

from posttrain.trainers.distillation import DistillationTrainer
from posttrain.trainers.distillation_config import DistillationConfig

__all__ = ["DistillationConfig", "DistillationTrainer"]
