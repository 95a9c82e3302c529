"""Asynchronous GRPO with TRL's `trl.experimental.async_grpo` API, on the online engine's asynchronous producer
(posttrain/online/producers/thread.py): a background thread samples the rounds up to `max_staleness` rounds ahead
of the one training, with weights refreshed every `weight_sync_steps` optimizer steps, by default on a vLLM server
(`posttrain vllm-serve MODEL`; use_vllm=False samples with a copy of the policy through transformers instead).

What TRL's asynchronous trainer computes, and so this one: each completion's advantage is its reward minus its
group's mean over the group's population standard deviation (+1e-8); the clipped surrogate's ratio is taken
against the sampler's own log-probs (the behaviour policy, however stale), so the clip bounds how far an update
moves from the weights that sampled; no KL term; the loss is the token mean of each micro-batch (loss_type
'bnpo'). Rollouts never exceed max_staleness rounds of age, so none is dropped (TRL drops the ones that do).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from posttrain.experimental._async_pipeline import (
    PIPELINE_UNSUPPORTED,
    AsyncPipelineFields,
    apply_dtype,
    refuse_trl_workers,
)
from posttrain.online.rollout import Advantages, Rollout, groupwise_advantages
from posttrain.trainers.grpo import GRPOConfig, GRPOTrainer
from posttrain.training.fields import config_field

__all__ = ["AsyncGRPOConfig", "AsyncGRPOTrainer", "population_group_advantages"]


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


def population_group_advantages(rewards: torch.Tensor, num_generations: int, eps: float = 1e-8) -> torch.Tensor:
    """(r - mean) / (population std + eps) within each prompt's group, over the scored completions (NaN: no
    reward applies, advantage 0), as TRL's asynchronous GRPO computes them."""
    return groupwise_advantages(
        rewards, num_generations, lambda group: (group - group.mean()) / (group.std(correction=0) + eps)
    )


class AsyncGRPOTrainer(GRPOTrainer):
    """`AsyncGRPOTrainer(model, reward_funcs, args=AsyncGRPOConfig(...), train_dataset=...)`."""

    _name = "GRPO"
    config_class = AsyncGRPOConfig
    accepts_images = False  # the generation thread samples text prompts

    def __init__(
        self,
        model,
        reward_funcs=None,
        args: AsyncGRPOConfig | None = None,
        train_dataset=None,
        processing_class=None,
        callbacks=None,
        optimizers=(None, None),
        peft_config=None,
        tools=None,
        environment_factory=None,
        rollout_worker=None,
        weight_transfer=None,
        **kwargs,
    ):
        refuse_trl_workers("AsyncGRPOTrainer", rollout_worker, weight_transfer)
        if args is None:
            name = model if isinstance(model, str) else type(model).__name__
            args = AsyncGRPOConfig(output_dir=f"{name.rstrip('/').split('/')[-1]}-AsyncGRPO")
        apply_dtype(model, args)
        super().__init__(
            model,
            reward_funcs,
            args=args,
            train_dataset=train_dataset,
            processing_class=processing_class,
            callbacks=callbacks,
            optimizers=optimizers,
            peft_config=peft_config,
            tools=tools,
            environment_factory=environment_factory,
            **kwargs,
        )

    def compute_advantages(self, rewards: torch.Tensor, rollout: Rollout) -> Advantages:
        return Advantages(self.local_share(population_group_advantages(rewards, rollout.num_generations)))

    @property
    def needs_old_logps(self) -> bool:
        return False  # the sampler's log-probs are the old log-probs

    def policy_tensors(self, rollout: Rollout) -> dict[str, torch.Tensor]:
        return {**super().policy_tensors(rollout), "old_logps": rollout.sampler_logps}
