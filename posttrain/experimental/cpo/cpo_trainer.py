"""CPO: Contrastive Preference Optimization (Xu et al. 2024), and through its `loss_type` SimPO (Meng et al. 2024)
and AlphaPO (Gupta et al. 2025).

DPO without the reference model (its beta -> 0 limit against a uniform reference) plus a behaviour-cloning term:
cpo_alpha times the NLL of the chosen completions. SimPO compares per-token average log-probs with a target margin
gamma; AlphaPO reshapes the reward to (1 - p^-alpha) / alpha. Data, forward and metrics are ORPO's
(`ReferenceFreeTrainer`).
"""

from __future__ import annotations

from posttrain.experimental.cpo.cpo_config import CPOConfig
from posttrain.losses.reference_free import CPO_AVERAGED_TYPES, cpo_loss
from posttrain.training.reference_free import ReferenceFreeTrainer


class CPOTrainer(ReferenceFreeTrainer):
    """`CPOTrainer(model, args=CPOConfig(...), train_dataset=..., processing_class=..., peft_config=...)`, TRL's
    keyword arguments in TRL's order (posttrain's `quantization_config` after them).

    Loss per pair: the `loss_type` preference loss on summed (sigmoid, hinge) or per-token averaged (ipo, simpo)
    completion log-probs, plus cpo_alpha times the chosen completions' token-mean NLL over the micro-batch.
    """

    _name = "CPO"
    config_class = CPOConfig

    def sequence_scores(self, policy):
        return super().sequence_scores(policy) if self.args.loss_type in CPO_AVERAGED_TYPES else policy.logps

    def pair_losses(self, policy, logits, inputs):
        args = self.args
        half = policy.logps.shape[0] // 2
        scores = self.sequence_scores(policy)
        losses, chosen_rewards, rejected_rewards = cpo_loss(
            scores[:half],
            scores[half:],
            loss_type=args.loss_type,
            beta=args.beta,
            label_smoothing=args.label_smoothing,
            simpo_gamma=args.simpo_gamma,
            alpha=args.alpha,
        )
        # As TRL, the NLL is neither computed nor logged (0) when its weight is 0.
        nll = self.chosen_nll(policy) if args.cpo_alpha else losses.new_zeros(())
        return losses + args.cpo_alpha * nll, chosen_rewards, rejected_rewards, {"nll_loss": nll.detach()}


__all__ = ["CPOConfig", "CPOTrainer"]
