"""TRL's `trl.rewards.other_rewards` module path: the length and repetition rewards (`shaping.py`)."""

from posttrain.rewards.shaping import get_repetition_penalty_reward, get_soft_overlong_punishment

__all__ = ["get_repetition_penalty_reward", "get_soft_overlong_punishment"]
