"""Group Relative Policy Optimization (Shao et al. 2024, DeepSeekMath): each prompt gets num_generations
completions, and a completion's advantage is its reward relative to the others of its group. No value
model; the KL to the reference (beta > 0) is a k3 penalty per token in the loss.

Variants through the config: scale_rewards="none" with loss_type="dr_grpo" is Dr. GRPO (Liu et al. 2025);
loss_type="dapo" with epsilon_high=0.28 and mask_truncated_completions=True is DAPO (Yu et al. 2025);
importance_sampling_level="sequence" is GSPO (Zheng et al. 2025).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

import torch

from ..losses.advantages import SCALE_REWARDS, group_advantages
from .online import OnlineConfig, OnlineTrainer, Rollout, groupwise_advantages, nanstd

# group_advantages' own epsilon, used the same way when the batch std is taken over scored rewards only.
_STD_EPS = 1e-4


@dataclass
class GRPOConfig(OnlineConfig):
    """OnlineConfig with GRPO's defaults: 8 generations per prompt, rewards scaled by their group's std,
    loss_type "dapo" (mean over all completion tokens of the optimizer step), no KL (beta=0)."""

    min_num_generations: ClassVar[int] = 2
    method: ClassVar[str] = "GRPO"

    scale_rewards: str = field(
        default="group", metadata={"help": f"Divide centred rewards by a std, one of {SCALE_REWARDS}: 'group' (the "
                                           "prompt's group), 'batch' (the whole generation batch), 'none' (Dr. GRPO)."})

    def __post_init__(self):
        super().__post_init__()
        self._check_choice("scale_rewards", self.scale_rewards, SCALE_REWARDS)


class GRPOTrainer(OnlineTrainer):
    """`GRPOTrainer(model, reward_funcs, args=GRPOConfig(...), train_dataset=..., peft_config=...)`."""

    config_class = GRPOConfig

    def compute_advantages(self, rewards: torch.Tensor, rollout: Rollout) -> torch.Tensor:
        scale = self.args.scale_rewards
        per_group = "none" if scale == "batch" else scale
        advantages = groupwise_advantages(rewards, self.args.num_generations,
                                          lambda group: group_advantages(group, group.numel(), per_group))
        if scale == "batch":
            advantages = advantages / (nanstd(rewards) + _STD_EPS)
        return self.local_share(advantages)
