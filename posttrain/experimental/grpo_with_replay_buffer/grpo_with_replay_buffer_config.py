"""GRPOWithReplayBufferConfig: the settings of the grpo_with_replay_buffer trainer, at TRL's
`trl.experimental.grpo_with_replay_buffer.grpo_with_replay_buffer_config` path."""

from __future__ import annotations

from dataclasses import dataclass

from posttrain.trainers.grpo import GRPOConfig
from posttrain.training.fields import config_field


@dataclass
class GRPOWithReplayBufferConfig(GRPOConfig):
    """GRPOConfig plus the size of the replay buffer."""

    replay_buffer_size: int = config_field(
        64,
        "Groups with reward variance kept to replace later zero-variance groups, highest std(rewards) * "
        "sum|advantages| first (0: off, plain GRPO).",
        min=0,
    )
