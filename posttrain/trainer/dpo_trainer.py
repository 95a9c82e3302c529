"""TRL's `trl.trainer.dpo_trainer` import path; the trainer lives in `posttrain.trainers.dpo`."""

from posttrain.data.trl_collators import DataCollatorForPreference
from posttrain.data.trl_vision_collators import DataCollatorForVisionPreference
from posttrain.trainers.dpo import DPOTrainer
from posttrain.trainers.dpo_config import DPOConfig

__all__ = ["DataCollatorForVisionPreference", "DPOConfig", "DPOTrainer", "DataCollatorForPreference"]
