"""TRL's `trl.rewards.format_rewards` module path: the format rewards (`library.py`)."""

from posttrain.rewards.library import think_format_reward

__all__ = ["think_format_reward"]
