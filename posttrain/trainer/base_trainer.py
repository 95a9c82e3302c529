"""TRL's `trl.trainer.base_trainer` import path: `_BaseTrainer` is the base of every posttrain trainer."""

from posttrain.training.base import BaseTrainer as _BaseTrainer

__all__ = ["_BaseTrainer"]
