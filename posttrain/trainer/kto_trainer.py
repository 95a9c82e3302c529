"""TRL's `trl.trainer.kto_trainer` import path; the trainer lives in `posttrain.trainers.kto`."""

from posttrain.data.trl_collators import DataCollatorForUnpairedPreference
from posttrain.data.trl_vision_collators import DataCollatorForVisionUnpairedPreference
from posttrain.trainers.kto import KTOTrainer
from posttrain.trainers.kto_config import KTOConfig

__all__ = ["DataCollatorForVisionUnpairedPreference", "DataCollatorForUnpairedPreference", "KTOConfig", "KTOTrainer"]
