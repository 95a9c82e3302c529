"""TRL's `trl.trainer.grpo_trainer` import path; the trainer lives in `posttrain.trainers.grpo`."""

from posttrain.trainers.grpo import GRPOTrainer
from posttrain.trainers.grpo_config import GRPOConfig

__all__ = ["GRPOConfig", "GRPOTrainer"]
