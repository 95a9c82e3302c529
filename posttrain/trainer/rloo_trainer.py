"""TRL's `trl.trainer.rloo_trainer` import path; the trainer lives in `posttrain.trainers.rloo`."""

from posttrain.trainers.rloo import RLOOTrainer
from posttrain.trainers.rloo_config import RLOOConfig

__all__ = ["RLOOConfig", "RLOOTrainer"]
