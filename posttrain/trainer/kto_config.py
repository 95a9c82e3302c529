"""TRL's `trl.trainer.kto_config` import path; the config lives in `posttrain.trainers.kto_config`."""

from posttrain.trainers.kto_config import KTOConfig

__all__ = ["KTOConfig"]
