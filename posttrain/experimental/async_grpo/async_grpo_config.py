"""AsyncGRPOConfig: the settings of the async_grpo trainer, at TRL's `trl.experimental.async_grpo.async_grpo_config`
path."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from posttrain.online.async_pipeline import (
    PIPELINE_UNSUPPORTED,
    AsyncPipelineFields,
)
from posttrain.trainers.grpo import GRPOConfig
from posttrain.training.fields import config_field


@dataclass
class AsyncGRPOConfig(AsyncPipelineFields, GRPOConfig):
    """GRPOConfig with TRL's asynchronous-GRPO fields and defaults (vLLM server, max_staleness 4, 2048-token
    completions, constant learning rate, a log every step)."""

    unsupported_options: ClassVar[dict[str, str]] = {
        **GRPOConfig.unsupported_options,
        "fork_threshold_tokens": "posttrain never re-tokenizes a conversation (a turn's token ids are appended as "
        "sampled), so there is no drift to fork a training row on.",
        **PIPELINE_UNSUPPORTED,
        "scale_rewards": "asynchronous GRPO divides by the group's population std as TRL's does; for another "
        "scaling use GRPOTrainer with async_generation_rounds.",
        "multi_objective_aggregation": "asynchronous GRPO sums the weighted rewards as TRL's does; for GDPO use "
        "GRPOTrainer with async_generation_rounds.",
        "vllm_importance_sampling_correction": "the ratio is already taken against the sampler's log-probs, so a "
        "correction by pi_old / pi_sampler is always 1.",
    }
    method: ClassVar[str] = "asynchronous GRPO"

    lr_scheduler_type: str = config_field("constant", "Learning-rate schedule.")
    loss_type: str = config_field(
        "bnpo",
        "Loss aggregation (GRPOConfig.loss_type); TRL's asynchronous trainer takes the token mean of each "
        "micro-batch, 'bnpo'.",
    )
    fork_threshold_tokens: int = config_field(
        1024,
        "TRL: re-tokenization drift, in tokens, that forks a multi-turn training row (posttrain never "
        "re-tokenizes: only the default).",
    )
    vllm_importance_sampling_correction: bool = config_field(
        False, "Not used: the ratio is taken against the sampler's log-probs already (only False)."
    )

    def __post_init__(self):
        self.resolve_async_pipeline()
        super().__post_init__()
