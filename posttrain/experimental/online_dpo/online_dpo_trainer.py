"""Online DPO (Guo et al. 2024, "Direct Language Model Alignment from Online AI Feedback", arXiv:2402.04792).

Each prompt gets two completions sampled from the current policy; reward functions, a reward model or a pairwise
judge pick the chosen one, and the DPO loss (sigmoid or IPO) against the reference model trains on the pair. The
pairing, scoring and sampling are the shared base's (posttrain/online/paired_preference.py); this module gives the
DPO pair loss.

As in TRL: per_device_train_batch_size counts prompts (a micro-batch holds both completions of each), the
log-probs of the loss are taken at temperature 1 (the sampling temperature only shapes sampling), max_length
truncates prompt + completion from the left for the forward pass, missing_eos_penalty is subtracted from the
score of a completion without EOS, ties go to the first completion, and beta (a list) changes with the epoch.
"""

from __future__ import annotations

import torch

from posttrain.experimental.online_dpo.online_dpo_config import OnlineDPOConfig
from posttrain.losses.online_preference import online_dpo_loss
from posttrain.online.paired_preference import PairedPreferenceTrainer


class OnlineDPOTrainer(PairedPreferenceTrainer):
    """`OnlineDPOTrainer(model, ref_model=None, reward_funcs=..., args=OnlineDPOConfig(...), train_dataset=...)`.

    `reward_funcs` score completions (functions, reward models or their paths, as in GRPO); posttrain also takes
    `judge`, a `BasePairwiseJudge` that picks the better completion of each pair, instead of them.
    """

    _name = "Online DPO"
    config_class = OnlineDPOConfig

    def pair_loss(self, inputs, logps, ref_logps, mask) -> tuple[torch.Tensor, dict]:
        """Per-pair losses [P] of a micro-batch (0 where the pair has no preference) and its metrics."""
        beta = self.beta
        sums, ref_sums = (logps * mask).sum(1).view(-1, 2), (ref_logps * mask).sum(1).view(-1, 2)
        preference = inputs["advantages"].view(-1, 2)
        valid, first = preference[:, 0] != 0, (preference[:, 0] > 0).long()
        rows = torch.arange(len(first), device=first.device)
        losses, chosen_rewards, rejected_rewards = online_dpo_loss(
            sums[rows, 1 - first],
            sums[rows, first],
            ref_sums[rows, 1 - first],
            ref_sums[rows, first],
            beta,
            self.args.loss_type,
        )
        losses = losses * valid
        kl = (sums - ref_sums).detach().reshape(-1)
        scores = inputs["returns"]
        metrics = {
            "objective/kl": kl.mean(),
            "objective/entropy": -sums.detach().mean(),
            "objective/non_score_reward": (-beta * kl).mean(),
            "objective/rlhf_reward": (scores - beta * kl).mean(),
            "beta": beta,
        }
        if valid.any():
            margins = (chosen_rewards - rejected_rewards)[valid]
            metrics.update(
                {
                    "rewards/chosen": chosen_rewards[valid].mean(),
                    "rewards/rejected": rejected_rewards[valid].mean(),
                    "rewards/margins": margins.mean(),
                    "rewards/accuracies": (margins > 0).float().mean(),
                    "logps/chosen": sums[rows, 1 - first][valid].detach().mean(),
                    "logps/rejected": sums[rows, first][valid].detach().mean(),
                }
            )
        return losses, metrics


__all__ = ["OnlineDPOConfig", "OnlineDPOTrainer"]
