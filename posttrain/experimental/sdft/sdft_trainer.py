"""TRL's `trl.experimental.sdft.sdft_trainer` path."""

from posttrain.experimental.sdft import SDFTConfig, SDFTTrainer

__all__ = ["SDFTConfig", "SDFTTrainer"]
