"""TRL's `trl.experimental.prm` path: re-exports of its config and trainer modules."""

from posttrain.experimental.prm.prm_config import PRMConfig
from posttrain.experimental.prm.prm_trainer import PRMTrainer, prm_reward_func, tokenize_steps

__all__ = ["PRMConfig", "PRMTrainer", "prm_reward_func", "tokenize_steps"]
