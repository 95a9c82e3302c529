"""TRL's `trl.trainer.rloo_config` import path; the config lives in `posttrain.trainers.rloo_config`."""

from posttrain.trainers.rloo_config import RLOOConfig

__all__ = ["RLOOConfig"]
