"""TRL's `trl.experimental.sdft.sdft_config` path."""

from posttrain.experimental.sdft import SDFTConfig

__all__ = ["SDFTConfig"]
