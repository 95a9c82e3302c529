"""TRL's `trl.trainer.grpo_config` import path; the config lives in `posttrain.trainers.grpo_config`."""

from posttrain.trainers.grpo_config import GRPOConfig

__all__ = ["GRPOConfig"]
