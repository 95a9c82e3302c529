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

import torch

from posttrain.losses.advantages import leave_one_out_advantages, whiten
from posttrain.online.engine import Advantages, OnlineTrainer, Rollout, groupwise_advantages
from posttrain.trainers.rloo_config import RLOOConfig


class RLOOTrainer(OnlineTrainer):
    """REINFORCE Leave-One-Out: online training where each completion's baseline is the mean reward of the other
    completions of its prompt.

    `RLOOTrainer(model, reward_funcs, args=RLOOConfig(...), train_dataset=..., peft_config=...)`.

    See docs/trainers/rloo.md.
    """

    _name = "RLOO"  # the method the model card names and cites (posttrain/training/model_card.py)

    config_class = RLOOConfig
    loss_reads_sampler_logps = True  # its policy_loss weighs each token by the sampler's log-prob
    kl_in_loss = False
    accepts_images = True  # image prompts (posttrain/online/vision.py)

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
