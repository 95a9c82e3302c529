"""TRL's `trl.trainer.sft_config` import path; the config lives in `posttrain.trainers.sft_config`."""

from posttrain.trainers.sft_config import SFTConfig

__all__ = ["SFTConfig"]
