"""TRL's `trl.trainer.reward_trainer` import path; the trainer lives in `posttrain.trainers.reward`."""

from posttrain.data.trl_collators import DataCollatorForPreference
from posttrain.trainers.reward import RewardTrainer
from posttrain.trainers.reward_config import RewardConfig

__all__ = ["DataCollatorForPreference", "RewardConfig", "RewardTrainer"]
