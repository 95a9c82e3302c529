"""ORPO: Monolithic Preference Optimization without Reference Model (Hong et al. 2024).

One stage instead of SFT then preference tuning: the loss is the chosen completions' negative log-likelihood plus
beta (the paper's lambda) times an odds-ratio term that pushes the odds of the chosen completion above those of the
rejected one. No reference model is kept.

`ReferenceFreeConfig` / `ReferenceFreeTrainer` hold what ORPO shares with CPO (`posttrain.experimental.cpo`): the
preference data layer of DPO (tokenization, `PreferenceCollator`, one forward for chosen and rejected), the
metrics, MoE aux loss, TRL's eval predictions and `generate_during_eval`. A subclass supplies `pair_losses`.
"""

from __future__ import annotations

import torch

from posttrain.experimental.orpo.orpo_config import ORPOConfig
from posttrain.losses.logprobs import next_token_logps
from posttrain.losses.reductions import masked_mean
from posttrain.losses.reference_free import log1mexp, orpo_loss
from posttrain.models.layouts import sequence_index
from posttrain.training.reference_free import ReferenceFreeTrainer


class ORPOTrainer(ReferenceFreeTrainer):
    """`ORPOTrainer(model, args=ORPOConfig(...), train_dataset=..., processing_class=..., peft_config=...)`, TRL's
    keyword arguments in TRL's order (posttrain's `quantization_config` after them).

    Loss per pair: NLL of the chosen micro-batch's prompt + completion tokens (token mean, as TRL) minus
    beta * log sigmoid(log odds ratio) of the per-token average completion log-probs.
    """

    _name = "ORPO"
    config_class = ORPOConfig

    def pair_losses(self, policy, logits, inputs):
        half = policy.logps.shape[0] // 2
        average = self.sequence_scores(policy)
        odds_losses, chosen_rewards, rejected_rewards, log_sigmoid_odds, log_odds = orpo_loss(
            average[:half], average[half:], beta=self.args.beta
        )
        nll = full_sequence_nll(logits, inputs, half)
        extra = {
            "nll_loss": nll.detach(),
            "log_odds_ratio": log_sigmoid_odds.mean(),
            "log_odds_chosen": log_odds.mean(),
        }
        return odds_losses + nll, chosen_rewards, rejected_rewards, extra


def full_sequence_nll(logits: torch.Tensor, batch: dict, pairs: int) -> torch.Tensor:
    """Token-mean NLL of the first `pairs` sequences (the chosen ones) over all their tokens, prompt included, as
    ORPO's SFT term is defined (each sequence's first token is predicted by nothing and left out)."""
    ids = batch["input_ids"]
    if "attention_mask" in batch:  # padded: one sequence per row
        logits, ids = logits[:pairs], ids[:pairs]
        mask = batch["attention_mask"][:pairs].clone()
        mask[:, 0] = 0
    else:  # padding-free: one row, positions restart at 0 for each sequence
        mask = (batch["position_ids"] > 0) & (sequence_index(batch) < pairs)
    mask = mask.to(torch.float32)
    token_logps = next_token_logps(logits, ids)
    return -masked_mean(token_logps, mask)


__all__ = ["ORPOConfig", "ORPOTrainer", "log1mexp"]
