"""TRL's `trl.experimental.xpo` path: re-exports of its config and trainer modules."""

from posttrain.experimental.xpo.xpo_config import XPOConfig
from posttrain.experimental.xpo.xpo_trainer import XPOTrainer

__all__ = ["XPOConfig", "XPOTrainer"]
