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

import torch

from posttrain.experimental.async_grpo.async_grpo_config import AsyncGRPOConfig
from posttrain.losses.advantages import population_group_advantages
from posttrain.online.async_pipeline import (
    apply_dtype,
    refuse_trl_workers,
)
from posttrain.online.rollout import Advantages, Rollout
from posttrain.trainers.grpo import GRPOTrainer
from posttrain.training.run_artifacts import default_output_dir

__all__ = ["AsyncGRPOConfig", "AsyncGRPOTrainer", "population_group_advantages"]


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
            args = AsyncGRPOConfig(output_dir=default_output_dir(name, "AsyncGRPO"))
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
