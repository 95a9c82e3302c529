"""TRL's `trl.experimental.grpo_with_replay_buffer` path: re-exports of its config and trainer modules."""

from posttrain.experimental.grpo_with_replay_buffer.grpo_with_replay_buffer_config import GRPOWithReplayBufferConfig
from posttrain.experimental.grpo_with_replay_buffer.grpo_with_replay_buffer_trainer import (
    GRPOWithReplayBufferTrainer,
    ReplayBuffer,
)

__all__ = ["GRPOWithReplayBufferConfig", "GRPOWithReplayBufferTrainer", "ReplayBuffer"]
