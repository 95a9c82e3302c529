"""TRL's `trl.trainer.model_config` import path; `ModelConfig` lives in `posttrain.cli.model`."""

from posttrain.cli.model import ModelConfig

__all__ = ["ModelConfig"]
