"""A2POConfig: the settings of the a2po trainer, at TRL's `trl.experimental.a2po.a2po_config` path."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from posttrain.errors import ConfigError
from posttrain.trainers.grpo import GRPOConfig
from posttrain.training.fields import (
    config_field,
    learning_rate_field,
    max_completion_length_field,
    max_prompt_length_field,
)


@dataclass
class A2POConfig(GRPOConfig):
    """GRPOConfig with A*-PO's fields and defaults: one completion per prompt, TRL's A2PO lengths and rate."""

    min_num_generations: ClassVar[int] = 1
    method: ClassVar[str] = "A2PO"

    learning_rate: float = learning_rate_field(5e-5)
    max_prompt_length: int | None = max_prompt_length_field(
        512, "Keep only the last this-many prompt tokens (TRL's A2PO default; None: no cut)."
    )
    max_completion_length: int = max_completion_length_field(256)
    num_generations: int = config_field(
        1, "Stage 2 completions per prompt (A*-PO uses 1; each is regressed on its own)."
    )
    num_value_samples: int = config_field(
        8, "Stage 1: completions sampled from the reference policy per prompt to estimate V*."
    )
    beta1: float = config_field(
        0.5, "Stage 1: KL temperature of V* = beta1 * log mean exp(r / beta1) (small: the best sample's reward)."
    )
    filter_all_incorrect: bool = config_field(
        True, "Stage 1: drop the training prompts whose reference samples all scored 0 (no learning signal)."
    )
    beta2: float = config_field(
        1e-3, "Stage 2: KL temperature of the implicit reward beta2 * log(pi / pi_ref) regressed onto r - V*."
    )

    def _check_loss_options(self) -> None:
        super()._check_loss_options()
        if self.num_value_samples < 1 or self.beta1 <= 0 or self.beta2 <= 0:
            raise ConfigError(
                f"A2PO needs num_value_samples >= 1 (it is {self.num_value_samples}), beta1 > 0 (it is "
                f"{self.beta1}) and beta2 > 0 (it is {self.beta2})."
            )
        refused = {
            "beta": self.beta != 0.0,
            "loss_type": self.loss_type != "dapo",
            "importance_sampling_level": self.importance_sampling_level != "token",
            "delta": self.delta is not None,
            "top_entropy_quantile": self.top_entropy_quantile != 1.0,
            "entropy_coef": self.entropy_coef != 0.0 or self.use_adaptive_entropy,
            "off_policy_mask_threshold": self.off_policy_mask_threshold is not None,
            "dynamic_sampling": self.dynamic_sampling,
            "scale_rewards": self.scale_rewards != "group",
            "multi_objective_aggregation": self.multi_objective_aggregation != "sum_then_normalize",
        }
        for name, is_set in refused.items():
            if is_set:
                raise ConfigError(
                    f"A2POConfig.{name}={getattr(self, name)!r} has no effect: A*-PO's loss is the "
                    "regression of beta2 * log(pi / pi_ref) onto r - V* (its KL temperature is beta2). "
                    "Leave it at its default, or use GRPOConfig/GRPOTrainer."
                )
