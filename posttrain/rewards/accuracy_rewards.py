"""TRL's `trl.rewards.accuracy_rewards` module path: the correctness rewards (`library.py`, `shaping.py`)."""

from posttrain.rewards.library import accuracy_reward, reasoning_accuracy_reward
from posttrain.rewards.shaping import get_cosine_scaled_reward

__all__ = ["accuracy_reward", "get_cosine_scaled_reward", "reasoning_accuracy_reward"]
