"""TRL's `trl.experimental.gold.gold_config` path."""

from posttrain.experimental.gold import GOLDConfig

__all__ = ["GOLDConfig"]
