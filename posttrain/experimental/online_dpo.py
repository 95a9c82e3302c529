"""Online DPO (Guo et al. 2024, "Direct Language Model Alignment from Online AI Feedback", arXiv:2402.04792).

Each prompt gets two completions sampled from the current policy; reward functions, a reward model or a pairwise
judge pick the chosen one, and the DPO loss (sigmoid or IPO) against the reference model trains on the pair. It
runs on the shared online engine (posttrain/online/engine.py): generate 2 per prompt -> score -> reference
log-probs (policy_tensors) -> "advantages" +1 chosen / -1 rejected / 0 no preference -> the pairwise loss.

XPO and Nash-MD (xpo.py, nash_md.py) reuse this trainer: they change where the second completion comes from
(`second_completions`) and the pair loss (`pair_loss`).

As in TRL: per_device_train_batch_size counts prompts (a micro-batch holds both completions of each), the
log-probs of the loss are taken at temperature 1 (the sampling temperature only shapes sampling), max_length
truncates prompt + completion from the left for the forward pass, missing_eos_penalty is subtracted from the
score of a completion without EOS, ties go to the first completion, and beta (a list) changes with the epoch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from posttrain.errors import ConfigError
from posttrain.experimental.judges import BasePairwiseJudge
from posttrain.losses.online_preference import online_dpo_loss, pair_preferences
from posttrain.online.engine import Advantages, OnlineConfig, OnlineTrainer, Rollout
from posttrain.training.fields import (
    check_value,
    config_field,
    declared_rules,
    disable_dropout_field,
    learning_rate_field,
    max_length_field,
)

__all__ = ["OnlineDPOConfig", "OnlineDPOTrainer"]


def epoch_value(values, epoch: float) -> float:
    """The value in force in `epoch` of a per-epoch setting (Online DPO's beta, XPO's alpha, Nash-MD's mixture_coef):
    a number, or a list whose i-th entry holds in epoch i and whose last holds after."""
    if not isinstance(values, (list, tuple)):
        return values
    index = int(epoch or 0)
    return values[index] if index < len(values) else values[-1]


def _check_schedule(name: str, values, rules: dict):
    """A float or a list of floats, each within the field's rules; one-element lists become the float (as TRL does)."""
    items = list(values) if isinstance(values, (list, tuple)) else [values]
    if not items:
        raise ConfigError(f"{name}=[] is empty; give a number or one number per epoch.")
    check_value(name, values, rules)
    return float(items[0]) if len(items) == 1 else [float(v) for v in items]


@dataclass
class OnlineDPOConfig(OnlineConfig):
    """OnlineConfig with online DPO's settings and TRL's defaults (2 completions per prompt, beta 0.1,
    temperature 0.9, 64 new tokens, learning rate 5e-7)."""

    min_num_generations: ClassVar[int] = 2
    method: ClassVar[str] = "Online DPO"
    schedules: ClassVar[tuple[str, ...]] = ("beta",)  # the fields that take one number per epoch

    learning_rate: float = learning_rate_field(5e-7)
    reward_model_path: str | None = config_field(
        None, "Path or name of a reward model that scores the completions, used when the trainer gets no reward_funcs."
    )
    max_new_tokens: int = config_field(64, "Most tokens generated per completion.", min=1)
    max_length: int | None = max_length_field(
        512,
        "Most prompt + completion tokens in the forward pass; longer sequences lose prompt tokens from the "
        "left (None: no limit).",
    )
    temperature: float = config_field(0.9, "Sampling temperature (> 0).")
    missing_eos_penalty: float | None = config_field(
        None, "Subtracted from the score of a completion that did not end with EOS (>= 0; None: no penalty).", min=0
    )
    beta: list[float] | float = config_field(
        help="Deviation from the reference (IPO's tau for loss_type='ipo'). A list gives one value per epoch, the "
        "last for the remaining epochs.",
        default_factory=lambda: [0.1],
        gt=0,
    )
    loss_type: str = config_field("sigmoid", "'sigmoid' (DPO) or 'ipo'.", choices=["sigmoid", "ipo"])
    num_generations: int = config_field(2, "Completions per prompt: always 2 (a pair).")
    disable_dropout: bool = disable_dropout_field(True, "Switch dropout off in the policy and the reference.")
    vllm_gpu_memory_utilization: float = config_field(
        0.55, "Colocate mode on a GPU: fraction of GPU memory vLLM may use (TRL's default for online DPO)."
    )

    def __post_init__(self):
        if self.num_generations != 2:
            raise ConfigError(
                f"num_generations={self.num_generations}: {self.method} compares exactly 2 completions "
                "per prompt; leave it at 2."
            )
        self.max_completion_length = self.max_new_tokens
        rules = declared_rules(type(self))
        schedules = {name: _check_schedule(name, getattr(self, name), rules[name][0]) for name in self.schedules}
        self.beta = epoch_value(schedules["beta"], 0)  # the engine's checks read one number
        super().__post_init__()
        for name, value in schedules.items():
            setattr(self, name, value)

    def _resolve_generation_batch(self) -> None:
        """per_device_train_batch_size counts prompts here (TRL's meaning); the engine counts completions."""
        prompts = self.per_device_train_batch_size
        self.per_device_train_batch_size = prompts * self.num_generations
        try:
            super()._resolve_generation_batch()
        finally:
            self.per_device_train_batch_size = prompts


class _JudgeReward:
    """A pairwise judge as a reward function over prompt-major pairs: 1.0 for the completion it prefers, 0.0 for
    the other; None for both where it could not decide (the pair is then left out of the loss). With `soft`, the
    pair gets (p, 1 - p), p the judge's probability that the first is better (Nash-MD)."""

    __name__ = "judge"

    def __init__(self, judge: BasePairwiseJudge, soft: bool = False) -> None:
        self.judge, self.soft = judge, soft

    @staticmethod
    def _text(value) -> str:
        if isinstance(value, list):  # messages
            return "\n".join(f"{m['role']}: {m['content']}" for m in value)
        return value

    def __call__(self, prompts, completions, **kwargs) -> list[float | None]:
        pairs = [
            (self._text(completions[i]).strip(), self._text(completions[i + 1]).strip())
            for i in range(0, len(completions), 2)
        ]
        firsts = [self._text(p) for p in prompts[::2]]
        if self.soft:
            scores = self.judge.judge(firsts, pairs, return_scores=True)
            return [v for p in scores for v in (float(p), 1.0 - float(p))]
        out = []
        for rank in self.judge.judge(firsts, pairs):
            out += [None, None] if rank not in (0, 1) else [1.0 - rank, float(rank)]
        return out


class OnlineDPOTrainer(OnlineTrainer):
    """`OnlineDPOTrainer(model, ref_model=None, reward_funcs=..., args=OnlineDPOConfig(...), train_dataset=...)`.

    `reward_funcs` score completions (functions, reward models or their paths, as in GRPO); posttrain also takes
    `judge`, a `BasePairwiseJudge` that picks the better completion of each pair, instead of them.
    """

    _name = "Online DPO"
    config_class = OnlineDPOConfig
    soft_judge: ClassVar[bool] = False  # whether a judge's soft scores are used (Nash-MD)

    def __init__(
        self,
        model,
        ref_model=None,
        reward_funcs=None,
        args: OnlineDPOConfig | None = None,
        data_collator=None,
        train_dataset=None,
        eval_dataset=None,
        processing_class=None,
        reward_processing_classes=None,
        peft_config=None,
        compute_metrics=None,
        callbacks=None,
        optimizers=(None, None),
        preprocess_logits_for_metrics=None,
        *,
        judge=None,
        quantization_config=None,
    ):
        args = args or self.config_class(output_dir=f"outputs/{type(self).__name__.removesuffix('Trainer').lower()}")
        if ref_model is not None and ref_model is model:
            raise ConfigError(
                "model and ref_model are the same object; pass ref_model=None to use a frozen copy "
                "of the model as the reference."
            )
        for name, value, why in (
            ("data_collator", data_collator, "the online engine batches prompts and completions itself"),
            (
                "compute_metrics",
                compute_metrics,
                "evaluation generates completions and logs their rewards and loss (eval_reward, eval_loss)",
            ),
            ("preprocess_logits_for_metrics", preprocess_logits_for_metrics, "evaluation keeps no logits"),
        ):
            if value is not None:
                raise ConfigError(f"{type(self).__name__} does not take {name}: {why}. Drop it.")
        reward_funcs = self._reward_sources(reward_funcs, judge, args)
        if isinstance(reward_processing_classes, (list, tuple)) or reward_processing_classes is None:
            processing_classes = reward_processing_classes
        else:
            processing_classes = [reward_processing_classes]
        self.judge = judge
        super().__init__(
            model,
            reward_funcs,
            args=args,
            train_dataset=train_dataset,
            eval_dataset=eval_dataset,
            processing_class=processing_class,
            reward_processing_classes=processing_classes,
            callbacks=callbacks,
            optimizers=optimizers,
            quantization_config=quantization_config,
            peft_config=peft_config,
        )
        if ref_model is not None:
            from posttrain.models.loading import load_causal_lm

            if isinstance(ref_model, str):
                ref_model = load_causal_lm(ref_model, args.model_init_kwargs)
            if args.disable_dropout:
                for module in ref_model.modules():
                    if isinstance(module, torch.nn.Dropout):
                        module.p = 0.0
            self.ref_model = self.accelerator.prepare_model(
                ref_model.eval().requires_grad_(False), evaluation_mode=True
            )

    def _reward_sources(self, reward_funcs, judge, args) -> list:
        if judge is not None:
            if reward_funcs is not None or args.reward_model_path is not None:
                raise ConfigError(
                    "Pass either a judge or reward_funcs/reward_model_path, not both: the judge alone "
                    "decides which completion is chosen."
                )
            if not isinstance(judge, BasePairwiseJudge):
                raise ConfigError(
                    f"judge is a {type(judge).__name__}; {type(self).__name__} needs a "
                    "BasePairwiseJudge (e.g. posttrain.experimental.judges.RewardModelPairwiseJudge)."
                )
            return [_JudgeReward(judge, soft=self.soft_judge)]
        if reward_funcs is not None and args.reward_model_path is not None:
            raise ConfigError(
                "Both reward_funcs and args.reward_model_path are set; pass the reward model in "
                "reward_funcs or drop reward_model_path."
            )
        if reward_funcs is None and args.reward_model_path is None:
            raise ConfigError(
                f"{type(self).__name__} needs reward_funcs (functions, reward models or their "
                "paths), args.reward_model_path, or a judge to rank each pair of completions."
            )
        return reward_funcs if reward_funcs is not None else [args.reward_model_path]

    # -- engine hooks ------------------------------------------------------------------------------------
    uses_reference = True  # the DPO loss always reads the reference

    @property
    def micro_batch_size(self) -> int:
        return self.args.per_device_train_batch_size * 2  # both completions of each prompt

    @property
    def logps_temperature(self) -> float:
        return 1.0

    @property
    def needs_old_logps(self) -> bool:
        return False

    @property
    def beta(self) -> float:
        return epoch_value(self.args.beta, self.state.epoch)

    def build_rollout(self, *args, **kwargs) -> Rollout:
        """The engine's rollout, with prompts cut from the left so that prompt + completion fit max_length."""
        rollout = super().build_rollout(*args, **kwargs)
        max_length = self.args.max_length
        excess = rollout.prompt_ids.shape[1] + rollout.completion_ids.shape[1] - (max_length or 0)
        if max_length is not None and excess > 0:
            rollout.prompt_ids = rollout.prompt_ids[:, excess:]
            rollout.prompt_mask = rollout.prompt_mask[:, excess:]
        return rollout

    def pair_scores(self, rewards: torch.Tensor, rollout: Rollout) -> torch.Tensor:
        """[P, 2] scores of every pair of the round (all processes): rewards less missing_eos_penalty."""
        scores = rewards.clone()
        if self.args.missing_eos_penalty is not None:
            finished = self.accelerator.gather(rollout.finished)
            scores[~finished] -= self.args.missing_eos_penalty
        return scores.view(-1, 2)

    def compute_advantages(self, rewards: torch.Tensor, rollout: Rollout) -> Advantages:
        """+1 for the chosen completion, -1 for the rejected one, 0 for both where no preference exists (no
        reward applies, the judge failed, or a completion is truncated with mask_truncated_completions). The
        scores travel as `returns` for the metrics."""
        scores = self.pair_scores(rewards, rollout)
        first = pair_preferences(scores).float() * 2 - 1
        preference = torch.stack([first, -first], dim=1)
        valid = ~scores.isnan().any(1)
        if self.args.mask_truncated_completions:
            valid &= self.accelerator.gather(rollout.finished).view(-1, 2).all(1)
        preference = preference * valid.unsqueeze(1)
        finished = self.accelerator.gather(rollout.finished).float()
        margin = (scores.max(1).values - scores.min(1).values)[valid]
        metrics = {"val/contain_eos_token": float(finished.mean())}
        if valid.any():
            metrics.update(
                {"objective/scores": float(scores[valid].mean()), "objective/scores_margin": float(margin.mean())}
            )
        return Advantages(
            self.local_share(preference.reshape(-1)), returns=self.local_share(scores.reshape(-1)), metrics=metrics
        )

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        logps, _ = self.completion_logps(model, inputs)
        mask = inputs["model_mask"].to(logps.dtype)
        ref_logps = inputs["ref_logps"][:, : logps.shape[1]]
        losses, metrics = self.pair_loss(inputs, logps, ref_logps, mask)
        pairs = inputs["total_sequences"] // 2  # pairs of the optimizer step, all processes
        loss = losses.sum() / pairs * self.accelerator.num_processes
        self.record_metrics(metrics)
        return (loss, None) if return_outputs else loss

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
