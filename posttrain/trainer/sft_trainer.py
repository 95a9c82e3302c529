"""TRL's `trl.trainer.sft_trainer` import path; the trainer lives in `posttrain.trainers.sft`."""

from posttrain.data.trl_collators import DataCollatorForLanguageModeling
from posttrain.data.trl_vision_collators import DataCollatorForVisionLanguageModeling
from posttrain.trainers.sft import SFTTrainer
from posttrain.trainers.sft_config import SFTConfig

__all__ = ["DataCollatorForVisionLanguageModeling", "DataCollatorForLanguageModeling", "SFTConfig", "SFTTrainer"]
