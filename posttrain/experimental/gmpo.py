"""Geometric-Mean Policy Optimization (Zhao et al. 2025, arXiv:2507.20673), at TRL's import path
`trl.experimental.gmpo`: GRPO whose sequence weight is the geometric mean of its token ratios, clipped per token
in log space (`posttrain.losses.grpo_family.gmpo_objective`). Generation, rewards and advantages are GRPO's.

epsilon / epsilon_high are log-space bounds: ratios are kept in (exp(-epsilon), exp(epsilon_high)); the paper's
(and TRL's) default is 0.4 on both sides. The loss is a mean over completions (the token normalisation lives
inside the geometric mean), so GRPO's loss_type and the options that reshape its per-token surrogate do not apply
and are refused when the config is built.
"""

from __future__ import annotations

from dataclasses import dataclass

from posttrain.errors import ConfigError
from posttrain.losses.grpo_family import gmpo_objective
from posttrain.losses.policy import objective_metrics
from posttrain.trainers.grpo import GRPOConfig, GRPOTrainer
from posttrain.training.fields import config_field

__all__ = ["GMPOConfig", "GMPOTrainer"]


@dataclass
class GMPOConfig(GRPOConfig):
    """GRPOConfig with GMPO's log-space clip range (epsilon=0.4)."""

    method = "GMPO"

    epsilon: float = config_field(
        0.4, "Lower clip bound in log space: a token's ratio is kept above exp(-epsilon). GMPO recommends 0.4."
    )
    epsilon_high: float | None = config_field(
        None, "Upper clip bound in log space: a token's ratio is kept below exp(epsilon_high) (None: epsilon)."
    )

    def _check_loss_options(self) -> None:
        super()._check_loss_options()
        refused = {
            "loss_type": (
                self.loss_type != "dapo",
                "GMPO's loss is a mean over completions of the geometric-mean surrogate, whatever loss_type says",
            ),
            "importance_sampling_level": (
                self.importance_sampling_level != "token",
                "the geometric mean is already a sequence-level weight",
            ),
            "delta": (self.delta is not None, "the log-space clip already bounds each token's ratio"),
            "off_policy_mask_threshold": (
                self.off_policy_mask_threshold is not None,
                "GMPO has no off-policy sequence masking",
            ),
            "entropy_coef": (self.entropy_coef != 0.0 or self.use_adaptive_entropy, "GMPO has no entropy bonus"),
            "vllm_importance_sampling_correction": (
                self.use_vllm and self.vllm_importance_sampling_correction,
                "GMPO's loss has no sampler-mismatch correction",
            ),
        }
        for name, (is_set, why) in refused.items():
            if is_set:
                raise ConfigError(
                    f"GMPOConfig.{name}={getattr(self, name)!r} has no effect: {why}. Leave it at its "
                    "default (for vLLM: vllm_importance_sampling_correction=False), or use "
                    "GRPOConfig/GRPOTrainer."
                )


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
