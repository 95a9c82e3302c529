"""TRL's `trl.experimental.distillation` path: re-exports of its config and trainer modules."""

from posttrain.experimental.distillation.distillation_config import DistillationConfig
from posttrain.experimental.distillation.distillation_trainer import DistillationTrainer

__all__ = ["DistillationConfig", "DistillationTrainer"]
