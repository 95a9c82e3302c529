"""TRL's `trl.trainer.kto_trainer` import path; the trainer lives in `posttrain.trainers.kto`."""

from posttrain.trainers.kto import KTOTrainer
from posttrain.trainers.kto_config import KTOConfig

__all__ = ["KTOConfig", "KTOTrainer"]
