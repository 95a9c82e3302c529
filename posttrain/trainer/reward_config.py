"""TRL's `trl.trainer.reward_config` import path; the config lives in `posttrain.trainers.reward_config`."""

from posttrain.trainers.reward_config import RewardConfig

__all__ = ["RewardConfig"]
