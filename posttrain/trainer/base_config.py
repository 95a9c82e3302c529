"""TRL's `trl.trainer.base_config` import path: `_BaseConfig` is the base of every posttrain config
(`posttrain.training.base.PosttrainConfig`), so code that patches `_BaseConfig.__post_init__` (as TRL's test
conftest does) reaches every config."""

from posttrain.training.base import PosttrainConfig as _BaseConfig

__all__ = ["_BaseConfig"]
