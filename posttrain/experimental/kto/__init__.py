"""TRL's `trl.experimental.kto` path: re-exports of its config and trainer modules."""

from posttrain.experimental.kto.kto_config import KTOConfig
from posttrain.experimental.kto.kto_trainer import KTOTrainer

__all__ = ["KTOConfig", "KTOTrainer"]
