"""TRL's `trl.experimental.orpo` path: re-exports of its config and trainer modules."""

from posttrain.experimental.orpo.orpo_config import ORPOConfig
from posttrain.experimental.orpo.orpo_trainer import ORPOTrainer

__all__ = ["ORPOConfig", "ORPOTrainer"]
