"""TRL's `trl.experimental.sdft` path: re-exports of its config and trainer modules."""

from posttrain.experimental.sdft.sdft_config import SDFTConfig
from posttrain.experimental.sdft.sdft_trainer import SDFTTrainer

__all__ = ["SDFTConfig", "SDFTTrainer"]
