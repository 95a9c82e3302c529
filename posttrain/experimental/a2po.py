"""A*-PO, optimal advantage regression (Brantley et al. 2025, arXiv:2505.20686), at TRL's import path
`trl.experimental.a2po`, on the online engine.

Stage 1, before training: num_value_samples completions per prompt (training and eval prompts) are sampled from
the reference policy -- the policy itself before its first update -- and scored; V*(x) = beta1 * log(mean
exp(r / beta1)) is kept per prompt, and with filter_all_incorrect the training prompts whose samples all scored
0 are dropped. Stage 2: one on-policy completion per prompt (num_generations=1) and the loss
(beta2 * log(pi(y|x) / pi_ref(y|x)) - (r - V*(x)))^2 (`posttrain.losses.grpo_family.a2po_loss`). The reward is
meant to be binary (0/1). Stage 1 is seeded, so a resumed run re-estimates the same V* from the initial weights.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from posttrain.errors import ConfigError, DataError
from posttrain.generation.base import derive_seed
from posttrain.losses.grpo_family import a2po_loss, a2po_optimal_values
from posttrain.online.rollout import PROMPT_IDS_COLUMN, Advantages
from posttrain.trainers.grpo import GRPOConfig, GRPOTrainer
from posttrain.training.fields import (
    config_field,
    learning_rate_field,
    max_completion_length_field,
    max_prompt_length_field,
)

__all__ = ["A2POConfig", "A2POTrainer"]

_STAGE1_TAG = 20250526  # keeps Stage 1's sampling seeds apart from the rounds'


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


class A2POTrainer(GRPOTrainer):
    """`A2POTrainer(model, reward_funcs, args=A2POConfig(...), train_dataset=..., eval_dataset=...)`."""

    _name = "A2PO"
    config_class = A2POConfig

    def __init__(
        self,
        model,
        reward_funcs,
        args: A2POConfig | None = None,
        train_dataset=None,
        eval_dataset=None,
        processing_class=None,
        callbacks=None,
        optimizers=(None, None),
        reward_processing_classes=None,
        peft_config=None,
        quantization_config=None,
    ):
        super().__init__(
            model,
            reward_funcs,
            args=args,
            train_dataset=train_dataset,
            eval_dataset=eval_dataset,
            processing_class=processing_class,
            reward_processing_classes=reward_processing_classes,
            callbacks=callbacks,
            optimizers=optimizers,
            quantization_config=quantization_config,
            peft_config=peft_config,
        )
        self.optimal_values: dict[tuple[int, ...], float] | None = None
        self._round_values: torch.Tensor | None = None

    @property
    def uses_reference(self) -> bool:
        return True

    @property
    def logps_temperature(self) -> float:
        return 1.0  # log pi(y|x) of the model itself, as TRL's A2PO (not of the tempered sampler)

    # -- Stage 1 -------------------------------------------------------------------------------------------
    def estimate_optimal_values(self) -> None:
        """V* for every training and eval prompt from num_value_samples samples of the initial policy (the
        reference), then the filter of all-incorrect training prompts."""
        args, n = self.args, self.args.num_value_samples
        values, all_incorrect = {}, set()
        evals = self.eval_dataset.values() if isinstance(self.eval_dataset, dict) else [self.eval_dataset]
        for dataset in [self.train_dataset, *[self._prepared_eval(d) for d in evals if d is not None]]:
            for start in range(0, len(dataset), args.per_device_train_batch_size):
                rows = [dataset[i] for i in range(start, min(start + args.per_device_train_batch_size, len(dataset)))]
                seeds = [derive_seed(args.seed, _STAGE1_TAG, start + i) for i in range(len(rows))]
                scored = self.generate_and_score(rows, n, seeds, -1)
                rewards = scored.rewards.nan_to_num(0.0).view(len(rows), n).double()
                for row, value, group in zip(rows, a2po_optimal_values(rewards, args.beta1).tolist(), rewards):
                    key = tuple(row[PROMPT_IDS_COLUMN])
                    values[key] = value
                    if bool((group == 0).all()):
                        all_incorrect.add(key)
        self.optimal_values = values
        if args.filter_all_incorrect and all_incorrect:
            kept = self.train_dataset.filter(lambda row: tuple(row[PROMPT_IDS_COLUMN]) not in all_incorrect)
            if len(kept) < args.generation_batch_size // args.num_generations:
                raise DataError(
                    f"filter_all_incorrect dropped {len(self.train_dataset) - len(kept)} of "
                    f"{len(self.train_dataset)} prompts whose {n} reference samples all scored 0, leaving "
                    "fewer than one generation round needs; set filter_all_incorrect=False or add "
                    "prompts the model can solve."
                )
            self.train_dataset = kept

    def train(self, *args, **kwargs):
        if self.optimal_values is None:
            self.estimate_optimal_values()
        return super().train(*args, **kwargs)

    def evaluate(self, *args, **kwargs):
        if self.optimal_values is None:
            self.estimate_optimal_values()
        return super().evaluate(*args, **kwargs)

    # -- Stage 2 -------------------------------------------------------------------------------------------
    def make_rollout(self, rows, slots, round_index):
        n = (
            self.args.num_generations
            if self.rollout_mode == "train"
            else (self.args.num_generations_eval or self.args.num_generations)
        )
        values = [self.optimal_values[tuple(row[PROMPT_IDS_COLUMN])] for row in rows for _ in range(n)]
        self._round_values = torch.tensor(values, dtype=torch.float32, device=self.accelerator.device)
        return super().make_rollout(rows, slots, round_index)

    def compute_advantages(self, rewards, rollout) -> Advantages:
        """The optimal advantage r - V*(x) (the regression target), per completion."""
        target = self.local_share(rewards).nan_to_num(0.0) - self._round_values
        return Advantages(target, metrics={"v_star": float(self._round_values.mean())})

    def policy_loss(self, inputs, logps, entropy=None, keep=None):
        """This micro-batch's share of the step's mean squared regression error."""
        mask = inputs["loss_mask"].to(logps.dtype)
        sequence_logps = (torch.where(mask.bool(), logps, 0.0)).sum(1)
        ref_sequence_logps = (torch.where(mask.bool(), inputs["ref_logps"], 0.0)).sum(1)
        rewards = inputs["advantages"] + 0.0  # r - V*: V* enters only through the target
        per_sequence, stats = a2po_loss(
            sequence_logps, ref_sequence_logps, rewards, torch.zeros_like(rewards), self.args.beta2
        )
        loss = per_sequence.sum() / inputs["total_sequences"]
        return loss * self.accelerator.num_processes, stats
