"""TRL's `trl.trainer.reward_trainer` import path; the trainer lives in `posttrain.trainers.reward`."""

from posttrain.data.trl_collators import DataCollatorForPreference
from posttrain.models.from_path import suppress_seqcls_warning
from posttrain.trainers.reward import RewardTrainer
from posttrain.trainers.reward_config import RewardConfig

__all__ = ["DataCollatorForPreference", "RewardConfig", "RewardTrainer", "suppress_seqcls_warning"]
