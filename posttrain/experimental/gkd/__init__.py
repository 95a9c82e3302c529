"""TRL's `trl.experimental.gkd` path: re-exports of its config and trainer modules."""

from posttrain.experimental.gkd.gkd_config import GKDConfig
from posttrain.experimental.gkd.gkd_trainer import GKDTrainer

__all__ = ["GKDConfig", "GKDTrainer"]
