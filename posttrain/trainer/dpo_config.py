"""TRL's `trl.trainer.dpo_config` import path; the config lives in `posttrain.trainers.dpo_config`."""

from posttrain.trainers.dpo_config import DPOConfig

__all__ = ["DPOConfig"]
