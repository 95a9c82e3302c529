"""Nash-MD (Munos et al. 2023, "Nash Learning from Human Feedback", arXiv:2312.00886),
on the paired-preference trainer (posttrain/online/paired_preference.py).

Each prompt gets one completion y from the policy and one y' from the geometric mixture
pi_mix ∝ pi^(1 - mixture_coef) * pi_ref^mixture_coef (sampled token by token from both models' logits); the
reward functions or judge give P(y beats y'), and the policy follows the Nash mirror-descent step through the
REINFORCE surrogate of losses/online_preference.py:nash_md_loss (only y is trained on). As in TRL's former
NashMDTrainer, the preference is sigmoid(score(y) - score(y')) with reward functions, and the judge's soft
probability with a judge; `mixture_coef` (a list: one value per epoch) defaults to 0.5.
"""

from __future__ import annotations

import torch

from posttrain.experimental.nash_md.nash_md_config import NashMDConfig
from posttrain.losses.online_preference import geometric_mixture_logps, nash_md_loss
from posttrain.models.reference import reference_forward, unwrap
from posttrain.online.engine import Advantages, Rollout
from posttrain.online.paired_preference import (
    PairedPreferenceTrainer,
    PairedSamplerMixin,
    epoch_value,
    sample_completions,
)

__all__ = ["NashMDConfig", "NashMDTrainer", "sample_completions"]


class NashMDTrainer(PairedSamplerMixin, PairedPreferenceTrainer):
    """`NashMDTrainer(model, ref_model=None, reward_funcs=..., args=NashMDConfig(...), train_dataset=...)`."""

    _name = "Nash-MD"
    config_class = NashMDConfig
    soft_judge = True

    @property
    def mixture_coef(self) -> float:
        return epoch_value(self.args.mixture_coef, self.state.epoch)

    def second_logits(self, ids, mask, position_ids) -> torch.Tensor:
        policy = self._next_logits(unwrap(self.model), ids, mask, position_ids)
        with reference_forward(self.model, self.ref_model) as reference:
            ref = self._next_logits(reference, ids, mask, position_ids)
        return geometric_mixture_logps(policy.float(), ref.float(), self.mixture_coef)

    def compute_advantages(self, rewards: torch.Tensor, rollout: Rollout) -> Advantages:
        """Each pair's probability that the policy's completion wins (on both rows; NaN: no preference)."""
        scores = self.pair_scores(rewards, rollout)
        probability = scores[:, 0] if self.judge is not None else torch.sigmoid(scores[:, 0] - scores[:, 1])
        finished = self.accelerator.gather(rollout.finished).float().view(-1, 2)
        metrics = {
            "val/model_contain_eos_token": float(finished[:, 0].mean()),
            "val/ref_contain_eos_token": float(finished[:, 1].mean()),
            "objective/model_scores": float(scores[:, 0].nanmean()),
            "objective/mixture_scores": float(scores[:, 1].nanmean()),
        }
        return Advantages(
            self.local_share(probability.repeat_interleave(2)),
            returns=self.local_share(scores.reshape(-1)),
            metrics=metrics,
        )

    def pair_loss(self, inputs, logps, ref_logps, mask):
        beta = self.beta
        probability = inputs["advantages"][0::2]
        valid = ~probability.isnan()
        losses, score, kl = nash_md_loss(logps[0::2], ref_logps[0::2], mask[0::2], probability.nan_to_num(0.5), beta)
        sums = (logps.detach() * mask).sum(1)
        metrics = {
            "loss/kl": kl.mean(),
            "loss/score": score[valid].mean() if valid.any() else 0.0,
            "objective/entropy": -sums[0::2].mean(),
            "logps/chosen": sums[0::2].mean(),
            "logps/rejected": sums[1::2].mean(),
            "beta": beta,
            "mixture_coef": self.mixture_coef,
        }
        if valid.any():
            metrics.update(
                {
                    "rewards/probabilities": probability[valid].mean(),
                    "rewards/accuracies": (probability[valid] > 0.5).float().mean(),
                }
            )
        return losses * valid, metrics
