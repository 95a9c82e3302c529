"""TRL's `trl.experimental.sdpo` path: re-exports of its config and trainer modules."""

from posttrain.experimental.sdpo.sdpo_config import SDPOConfig
from posttrain.experimental.sdpo.sdpo_trainer import SDPOTrainer

__all__ = ["SDPOConfig", "SDPOTrainer"]
