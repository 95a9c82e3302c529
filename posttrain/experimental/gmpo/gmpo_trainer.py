"""Geometric-Mean Policy Optimization (Zhao et al. 2025, arXiv:2507.20673), at TRL's import path
`trl.experimental.gmpo`: GRPO whose sequence weight is the geometric mean of its token ratios, clipped per token
in log space (`posttrain.losses.grpo_family.gmpo_objective`). Generation, rewards and advantages are GRPO's.

epsilon / epsilon_high are log-space bounds: ratios are kept in (exp(-epsilon), exp(epsilon_high)); the paper's
(and TRL's) default is 0.4 on both sides. The loss is a mean over completions (the token normalisation lives
inside the geometric mean), so GRPO's loss_type and the options that reshape its per-token surrogate do not apply
and are refused when the config is built.
"""

from __future__ import annotations

from posttrain.experimental.gmpo.gmpo_config import GMPOConfig
from posttrain.losses.grpo_family import gmpo_objective
from posttrain.losses.policy import objective_metrics
from posttrain.trainers.grpo import GRPOTrainer

__all__ = ["GMPOConfig", "GMPOTrainer"]


class GMPOTrainer(GRPOTrainer):
    """`GMPOTrainer(model, reward_funcs, args=GMPOConfig(...), train_dataset=...)`: GRPOTrainer with GMPO's loss
    (top_entropy_quantile selects the tokens of the geometric mean, as in TRL)."""

    _name = "GMPO"
    config_class = GMPOConfig

    def __init__(self, model, reward_funcs, args: GMPOConfig | None = None, **kwargs):
        """TRL's signature: reward_funcs is required here (GRPOTrainer's other arguments by keyword)."""
        super().__init__(model, reward_funcs, args, **kwargs)

    def policy_loss(self, inputs, logps, entropy=None, keep=None):
        """This micro-batch's share of the step's mean over completions of GMPO's per-completion loss."""
        args, mask = self.args, inputs["loss_mask"]
        selected = self.high_entropy_tokens(entropy, mask)
        per_sequence, stats = gmpo_objective(
            logps,
            inputs.get("old_logps", logps.detach()),
            inputs["advantages"],
            mask,
            epsilon_low=args.epsilon,
            epsilon_high=args.epsilon_high,
            keep=selected,
            ref_logps=inputs.get("ref_logps"),
            beta=args.beta,
        )
        loss = per_sequence.sum() / inputs["total_sequences"]
        return loss * self.accelerator.num_processes, objective_metrics(stats, self.accelerator.gather)
