"""REINFORCE Leave-One-Out (Ahmadian et al. 2024, "Back to Basics"): each completion's baseline is the mean
reward of the other completions of its prompt, which keeps the policy gradient unbiased.

As in the paper, the KL to the reference is part of the reward: r - beta * sum_t (log pi(y_t) - log
pi_ref(y_t)) over the completion's tokens, before the baseline is taken. The default loss_type="dr_grpo"
sums each completion's per-token terms and averages over completions (divided by the constant
max_completion_length), i.e. the paper's REINFORCE estimator on the sequence log-probability, up to a
constant factor. With num_iterations or steps_per_generation > 1 the same clipped ratio as GRPO applies.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

import torch

from ..losses.advantages import leave_one_out_advantages, whiten
from .online import OnlineConfig, OnlineTrainer, Rollout, groupwise_advantages


@dataclass
class RLOOConfig(OnlineConfig):
    """OnlineConfig with RLOO's defaults: 2 generations per prompt, beta=0.05 as a KL penalty in the reward,
    loss_type "dr_grpo" (sequence-level REINFORCE), advantages not normalised."""

    min_num_generations: ClassVar[int] = 2
    method: ClassVar[str] = "RLOO"

    num_generations: int = field(default=2, metadata={"help": "Completions sampled per prompt (k in the paper)."})
    beta: float = field(default=0.05, metadata={"help": "KL coefficient: beta times the completion's summed log "
                                                        "ratio to the reference is subtracted from its reward."})
    loss_type: str = field(default="dr_grpo", metadata={"help": "Loss aggregation (see OnlineConfig); dr_grpo is "
                                                                "the paper's sequence-level estimator."})
    normalize_advantages: bool = field(
        default=False, metadata={"help": "Scale the advantages of each generation batch to mean 0 and std 1."})


class RLOOTrainer(OnlineTrainer):
    """`RLOOTrainer(model, reward_funcs, args=RLOOConfig(...), train_dataset=..., peft_config=...)`."""

    config_class = RLOOConfig
    kl_in_loss = False

    @property
    def needs_old_logps(self) -> bool:
        return super().needs_old_logps or self.args.beta > 0  # the KL penalty reads them

    def compute_advantages(self, rewards: torch.Tensor, rollout: Rollout) -> torch.Tensor:
        if self.args.beta > 0:
            log_ratio = (rollout.tensors["old_logps"] - rollout.tensors["ref_logps"]) * rollout.loss_mask
            rewards = rewards - self.args.beta * self.accelerator.gather(log_ratio.sum(1))
        advantages = groupwise_advantages(rewards, self.args.num_generations,
                                          lambda group: leave_one_out_advantages(group, group.numel()))
        if self.args.normalize_advantages:
            advantages = whiten(advantages, mask=~rewards.isnan())
        return self.local_share(advantages)
