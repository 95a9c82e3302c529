"""TRL's `trl.experimental.gmpo` path: re-exports of its config and trainer modules."""

from posttrain.experimental.gmpo.gmpo_config import GMPOConfig
from posttrain.experimental.gmpo.gmpo_trainer import GMPOTrainer

__all__ = ["GMPOConfig", "GMPOTrainer"]
