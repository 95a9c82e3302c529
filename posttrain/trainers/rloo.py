"""REINFORCE Leave-One-Out (Ahmadian et al. 2024, "Back to Basics"): each completion's baseline is the mean
reward of the other completions of its prompt, which keeps the policy gradient unbiased.

As in the paper, the KL to the reference is part of the reward: r - beta * sum_t (log pi(y_t) - log
pi_ref(y_t)) over the completion's tokens, before the baseline is taken (rewards are first clipped to
reward_clip_range when it is set). The default loss_type="dr_grpo" sums each completion's per-token terms
and averages over completions (divided by the constant max_completion_length), i.e. the paper's REINFORCE
estimator on the sequence log-probability, up to a constant factor. With num_iterations or
steps_per_generation > 1 the same clipped ratio as GRPO applies.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

import torch

from ..errors import ConfigError
from ..losses.advantages import leave_one_out_advantages, whiten
from .online import Advantages, OnlineConfig, OnlineTrainer, Rollout, groupwise_advantages


@dataclass
class RLOOConfig(OnlineConfig):
    """OnlineConfig with RLOO's defaults: 2 generations per prompt, beta=0.05 as a KL penalty in the reward,
    loss_type "dr_grpo" (sequence-level REINFORCE), advantages not normalised."""

    min_num_generations: ClassVar[int] = 2
    method: ClassVar[str] = "RLOO"

    num_generations: int = field(default=2, metadata={"help": "Completions sampled per prompt (k in the paper)."})
    beta: float = field(
        default=0.05,
        metadata={
            "help": "KL coefficient: beta times the completion's summed log "
            "ratio to the reference is subtracted from its reward."
        },
    )
    loss_type: str = field(
        default="dr_grpo",
        metadata={"help": "Loss aggregation (see OnlineConfig); dr_grpo is the paper's sequence-level estimator."},
    )
    normalize_advantages: bool = field(
        default=False, metadata={"help": "Scale the advantages of each generation batch to mean 0 and std 1."}
    )
    reward_clip_range: list[float] | None = field(
        default=None,
        metadata={
            "help": "[min, max]: clip each completion's (weighted) reward to this range "
            "before the KL penalty and the baseline (None: no clipping)."
        },
    )

    def __post_init__(self):
        super().__post_init__()
        if self.reward_clip_range is not None:
            low_high = list(self.reward_clip_range)
            if len(low_high) != 2 or not low_high[0] <= low_high[1]:
                raise ConfigError(
                    f"reward_clip_range={self.reward_clip_range!r} must be two numbers [min, max] with "
                    "min <= max (None: no clipping)."
                )
            self.reward_clip_range = tuple(float(v) for v in low_high)


class RLOOTrainer(OnlineTrainer):
    """`RLOOTrainer(model, reward_funcs, args=RLOOConfig(...), train_dataset=..., peft_config=...)`."""

    _name = "RLOO"  # the method the model card names and cites (posttrain/model_card.py)

    config_class = RLOOConfig
    kl_in_loss = False
    accepts_images = True  # image prompts (posttrain/trainers/online_vision.py)

    def __init__(
        self,
        model,
        reward_funcs,
        args: RLOOConfig | None = None,
        train_dataset=None,
        eval_dataset=None,
        processing_class=None,
        reward_processing_classes: list | None = None,
        callbacks=None,
        optimizers=(None, None),
        quantization_config=None,
        peft_config=None,
        *,
        tools=None,
        rollout_func=None,
        environment_factory=None,
    ):
        super().__init__(
            model,
            reward_funcs,
            args=args,
            train_dataset=train_dataset,
            eval_dataset=eval_dataset,
            processing_class=processing_class,
            reward_processing_classes=reward_processing_classes,
            callbacks=callbacks,
            optimizers=optimizers,
            quantization_config=quantization_config,
            peft_config=peft_config,
            tools=tools,
            rollout_func=rollout_func,
            environment_factory=environment_factory,
        )

    @property
    def needs_old_logps(self) -> bool:
        return super().needs_old_logps or self.args.beta > 0  # the KL penalty reads them

    def policy_loss(self, inputs, logps, *args, **kwargs):
        """The engine's loss; its per-token "kl" metric is left out: RLOO logs the KL of its reward penalty
        (mean log-ratio per completion token, once per round) under that name, as TRL does."""
        loss, metrics = super().policy_loss(inputs, logps, *args, **kwargs)
        metrics.pop("kl", None)
        return loss, metrics

    def compute_advantages(self, rewards: torch.Tensor, rollout: Rollout) -> Advantages:
        metrics = {}
        if self.args.reward_clip_range is not None:
            rewards = rewards.clamp(*self.args.reward_clip_range)  # NaN (no reward applies) stays NaN
        if self.args.beta > 0:
            log_ratio = (rollout.old_logps - rollout.ref_logps) * rollout.loss_mask
            rewards = rewards - self.args.beta * self.accelerator.gather(log_ratio.sum(1))
            totals = self.accelerator.gather(torch.stack([log_ratio.sum(), rollout.loss_mask.sum()]).reshape(1, 2))
            metrics["kl"] = float(totals[:, 0].sum() / totals[:, 1].sum().clamp(min=1))
        advantages = groupwise_advantages(
            rewards, rollout.num_generations, lambda group: leave_one_out_advantages(group, group.numel())
        )
        if self.args.normalize_advantages:
            advantages = whiten(advantages, mask=~rewards.isnan())
        return Advantages(self.local_share(advantages), metrics=metrics)
