"""TRL's `trl.experimental.bco` path: re-exports of its config and trainer modules."""

from posttrain.experimental.bco.bco_config import BCOConfig
from posttrain.experimental.bco.bco_trainer import BCOCollator, BCOTrainer

__all__ = ["BCOConfig", "BCOTrainer", "BCOCollator"]
