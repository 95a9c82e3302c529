"""GMPOConfig: the settings of the gmpo trainer, at TRL's `trl.experimental.gmpo.gmpo_config` path."""

from __future__ import annotations

from dataclasses import dataclass

from posttrain.errors import ConfigError
from posttrain.trainers.grpo import GRPOConfig
from posttrain.training.fields import config_field


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
