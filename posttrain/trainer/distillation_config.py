"""TRL's `trl.trainer.distillation_config` import path; the config lives in `posttrain.trainers.distillation_config`."""

from posttrain.trainers.distillation_config import DistillationConfig

__all__ = ["DistillationConfig"]
