"""TRL's `trl.experimental.async_grpo` path: re-exports of its config and trainer modules."""

from posttrain.experimental.async_grpo.async_grpo_config import AsyncGRPOConfig
from posttrain.experimental.async_grpo.async_grpo_trainer import AsyncGRPOTrainer, population_group_advantages

__all__ = ["AsyncGRPOConfig", "AsyncGRPOTrainer", "population_group_advantages"]
