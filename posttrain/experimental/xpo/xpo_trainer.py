"""XPO (Xie et al. 2024, "Exploratory Preference Optimization", arXiv:2405.21046),
on the paired-preference trainer (posttrain/online/paired_preference.py).

Each prompt gets one completion from the policy and one from the reference model; the reward functions or judge
rank the two, and the loss is the online DPO loss on that pair plus alpha * log pi(y_ref), the exploration term
of the paper's Algorithm 1 (losses/online_preference.py:xpo_loss). `alpha` (a list: one value per epoch)
defaults to 1e-5, as in TRL's former XPOTrainer.
"""

from __future__ import annotations

import torch

from posttrain.experimental.xpo.xpo_config import XPOConfig
from posttrain.losses.online_preference import xpo_loss
from posttrain.models.reference import reference_forward
from posttrain.online.engine import Advantages, Rollout
from posttrain.online.paired_preference import (
    PairedPreferenceTrainer,
    PairedSamplerMixin,
    epoch_value,
)

__all__ = ["XPOConfig", "XPOTrainer"]


class XPOTrainer(PairedSamplerMixin, PairedPreferenceTrainer):
    """`XPOTrainer(model, ref_model=None, reward_funcs=..., args=XPOConfig(...), train_dataset=...)`."""

    _name = "XPO"
    config_class = XPOConfig

    @property
    def alpha(self) -> float:
        return epoch_value(self.args.alpha, self.state.epoch)

    def second_logits(self, ids, mask, position_ids) -> torch.Tensor:
        with reference_forward(self.model, self.ref_model) as reference:
            return self._next_logits(reference, ids, mask, position_ids)

    def compute_advantages(self, rewards: torch.Tensor, rollout: Rollout) -> Advantages:
        estimate = super().compute_advantages(rewards, rollout)
        scores = self.pair_scores(rewards, rollout)
        finished = self.accelerator.gather(rollout.finished).float().view(-1, 2)
        estimate.metrics.pop("val/contain_eos_token")
        estimate.metrics.pop("objective/scores", None)
        estimate.metrics.update(
            {
                "val/model_contain_eos_token": float(finished[:, 0].mean()),
                "val/ref_contain_eos_token": float(finished[:, 1].mean()),
                "objective/model_scores": float(scores[:, 0].nanmean()),
                "objective/ref_scores": float(scores[:, 1].nanmean()),
            }
        )
        return estimate

    def pair_loss(self, inputs, logps, ref_logps, mask):
        beta, alpha = self.beta, self.alpha
        sums, ref_sums = (logps * mask).sum(1).view(-1, 2), (ref_logps * mask).sum(1).view(-1, 2)
        preference = inputs["advantages"].view(-1, 2)
        valid = preference[:, 0] != 0
        chosen = (preference[:, 0] <= 0).long()  # 0: the policy's completion is chosen, 1: the reference's
        rows = torch.arange(len(chosen), device=chosen.device)
        losses, dpo, exploration, margins = xpo_loss(
            sums[rows, chosen],
            sums[rows, 1 - chosen],
            ref_sums[rows, chosen],
            ref_sums[rows, 1 - chosen],
            sums[:, 1],
            beta,
            alpha,
            self.args.loss_type,
        )
        kl = (sums - ref_sums).detach()[:, 0]
        metrics = {
            "loss/dpo": dpo[valid].detach().mean() if valid.any() else 0.0,
            "loss/xpo": exploration.detach().mean(),
            "objective/kl": kl.mean(),
            "objective/entropy": -sums[:, 0].detach().mean(),
            "alpha": alpha,
            "beta": beta,
        }
        if valid.any():
            chosen_rewards = beta * (sums - ref_sums).detach()[rows, chosen]
            metrics.update(
                {
                    "rewards/chosen": chosen_rewards[valid].mean(),
                    "rewards/rejected": (chosen_rewards - margins)[valid].mean(),
                    "rewards/margins": margins[valid].mean(),
                    "rewards/accuracies": (margins[valid] > 0).float().mean(),
                    "logps/chosen": sums[rows, chosen][valid].detach().mean(),
                    "logps/rejected": sums[rows, 1 - chosen][valid].detach().mean(),
                }
            )
        return losses * valid, metrics
