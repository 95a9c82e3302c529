"""TRL's `trl.experimental.cpo` path: re-exports of its config and trainer modules."""

from posttrain.experimental.cpo.cpo_config import CPOConfig
from posttrain.experimental.cpo.cpo_trainer import CPOTrainer

__all__ = ["CPOConfig", "CPOTrainer"]
