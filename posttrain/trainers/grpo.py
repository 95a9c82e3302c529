"""Group Relative Policy Optimization (Shao et al. 2024, DeepSeekMath): each prompt gets num_generations
completions, and a completion's advantage is its reward relative to the others of its group. No value
model; the KL to the reference (beta > 0) is a k3 penalty per token in the loss.

Variants through the config: scale_rewards="none" with loss_type="dr_grpo" is Dr. GRPO (Liu et al. 2025);
loss_type="dapo" with epsilon_high=0.28 and mask_truncated_completions=True is DAPO (Yu et al. 2025);
importance_sampling_level="sequence" is GSPO (Zheng et al. 2025), "sequence_token" GSPO-token;
dynamic_sampling=True is DAPO's dynamic sampling (zero-variance groups replaced by groups generated for more
prompts). Other surrogates (loss_type cispo, sapo, luspo, vespo), two-sided clipping (delta), high-entropy
token selection (top_entropy_quantile), an entropy bonus with adaptive control, off-policy sequence masking,
the vLLM importance-sampling modes and GDPO's multi-objective aggregation are pure functions in
posttrain/losses/ (policy.py, token_weights.py, advantages.py) that this trainer wires in through
OnlineTrainer's hooks.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import ClassVar

import torch
from torch import nn
from transformers import TrainerCallback

from ..errors import ConfigError
from ..generation.base import derive_seed
from ..losses.advantages import (
    MULTI_OBJECTIVE_AGGREGATIONS,
    SCALE_REWARDS,
    AdaptiveEntropyController,
    decoupled_advantages,
    group_advantages,
)
from ..losses.policy import GRPO_LOSS_TYPES, VespoParams
from ..losses.token_weights import (
    IMPORTANCE_SAMPLING_MODES,
    high_entropy_mask,
    off_policy_sequence_mask,
    sampler_importance_weights,
)
from .online import Advantages, OnlineConfig, OnlineTrainer, Rollout, ScoredGroups, groupwise_advantages, nanstd

# group_advantages' own epsilon, used the same way when the batch std is taken over scored rewards only.
_STD_EPS = 1e-4


def _help(text: str) -> dict:
    return {"help": text}


@dataclass
class GRPOConfig(OnlineConfig):
    """OnlineConfig with GRPO's defaults: 8 generations per prompt, rewards scaled by their group's std,
    loss_type "dapo" (mean over all completion tokens of the optimizer step), no KL (beta=0)."""

    min_num_generations: ClassVar[int] = 2
    method: ClassVar[str] = "GRPO"
    loss_types: ClassVar[tuple[str, ...]] = GRPO_LOSS_TYPES

    cast_lm_head_to_fp32: bool = field(
        default=False,
        metadata=_help(
            "Keep the output layer of the policy and the reference in float32 and compute their logits in float32 "
            "(steadier log-probs when the model trains in bf16). A tied input embedding still outputs its dtype."
        ),
    )
    delta: float | None = field(
        default=None,
        metadata=_help(
            "Two-sided clipping (INTELLECT-2): also cap the unclipped ratio at delta, so negative advantages cannot "
            "push very large ratios further. None: off; else > 1 + epsilon."
        ),
    )
    sapo_temperature_neg: float = field(
        default=1.05, metadata=_help("loss_type='sapo': temperature of the soft gate for tokens with advantage <= 0.")
    )
    sapo_temperature_pos: float = field(
        default=1.0, metadata=_help("loss_type='sapo': temperature of the soft gate for tokens with advantage > 0.")
    )
    vespo_k_pos: float = field(
        default=2.0,
        metadata=_help(
            "loss_type='vespo', advantage >= 0: power k of the gamma weight w^k exp(-lambda w) (damps w < 1)."
        ),
    )
    vespo_lambda_pos: float = field(
        default=3.0,
        metadata=_help("loss_type='vespo', advantage >= 0: decay lambda of the gamma weight (damps w > 1)."),
    )
    vespo_k_neg: float = field(
        default=3.0, metadata=_help("loss_type='vespo', advantage < 0: power k of the gamma weight.")
    )
    vespo_lambda_neg: float = field(
        default=2.0, metadata=_help("loss_type='vespo', advantage < 0: decay lambda of the gamma weight.")
    )
    multi_objective_aggregation: str = field(
        default="sum_then_normalize",
        metadata=_help(
            f"With several reward functions, one of {MULTI_OBJECTIVE_AGGREGATIONS}: sum the weighted rewards then "
            "normalise as scale_rewards says, or (GDPO) normalise each function within its group, sum with the "
            "weights, then normalise over the batch (scale_rewards is not used then)."
        ),
    )
    scale_rewards: str = field(
        default="group",
        metadata=_help(
            f"Divide centred rewards by a std, one of {SCALE_REWARDS}: 'group' (the prompt's group; also True), "
            "'batch' (the whole generation batch), 'none' (Dr. GRPO; also False)."
        ),
    )
    loss_type: str = field(
        default="dapo",
        metadata=_help(
            f"One of {GRPO_LOSS_TYPES}. Clipped surrogate with an aggregation: grpo (mean per completion, then over "
            "completions), bnpo (token mean of the micro-batch), dapo (token mean of the optimizer step), dr_grpo "
            "(token sum / (completions x max_completion_length)), luspo (token sum / completions; use "
            "importance_sampling_level='sequence'). Other surrogates: cispo (clipped, detached ratio times log-prob; "
            "epsilon_high is its cap, ~5), sapo (soft sigmoid gate, grpo aggregation), vespo (smooth gamma weight of "
            "the sequence ratio, dapo aggregation)."
        ),
    )
    top_entropy_quantile: float = field(
        default=1.0,
        metadata=_help(
            "Train only on the top fraction of completion tokens by entropy (rho in 'Beyond the 80/20 rule'; the "
            "paper uses 0.2). 1.0 keeps every token, 0.0 only the highest."
        ),
    )
    entropy_coef: float = field(
        default=0.0,
        metadata=_help(
            "Entropy bonus: subtract entropy_coef x the mean token entropy (over the trained tokens) from the loss, "
            "whatever the loss_type. With use_adaptive_entropy it is the starting coefficient."
        ),
    )
    use_adaptive_entropy: bool = field(
        default=False,
        metadata=_help(
            "Skywork-OR1's adaptive entropy control: after each optimizer step raise entropy_coef by "
            "entropy_coef_delta if the entropy was <= entropy_target, else lower it; the bonus applies only while "
            "the entropy is <= entropy_target. The coefficient is saved in checkpoints."
        ),
    )
    entropy_coef_min: float = field(default=0.0, metadata=_help("Adaptive entropy control: lowest coefficient."))
    entropy_coef_max: float = field(default=1.0, metadata=_help("Adaptive entropy control: highest coefficient."))
    entropy_coef_delta: float = field(
        default=0.005, metadata=_help("Adaptive entropy control: change of the coefficient per optimizer step.")
    )
    entropy_target: float = field(
        default=0.2,
        metadata=_help(
            "Adaptive entropy control: target mean token entropy in nats, over the trained tokens. Language models "
            "usually sit at 2-10 nats; set it near the entropy seen early in training."
        ),
    )
    vllm_importance_sampling_mode: str = field(
        default="sequence_mask",
        metadata=_help(
            f"How vLLM's sampling mismatch is corrected, one of {IMPORTANCE_SAMPLING_MODES}: a ratio per token or per "
            "sequence (product of token ratios); ratios outside [clip_min, clip_max] truncated to the range or set to "
            "0."
        ),
    )
    vllm_importance_sampling_clip_max: float | None = field(
        default=3.0, metadata=_help("Upper bound of the vLLM importance ratio (None: open).")
    )
    vllm_importance_sampling_clip_min: float | None = field(
        default=None, metadata=_help("Lower bound of the vLLM importance ratio (None: open).")
    )
    off_policy_mask_threshold: float | None = field(
        default=None,
        metadata=_help(
            "DeepSeek-V3.2's off-policy sequence masking: drop completions with a negative advantage whose mean "
            "log(pi_sampler / pi) exceeds this (e.g. 0.5). None: off."
        ),
    )
    use_bias_correction_kl: bool = field(
        default=True,
        metadata=_help(
            "Multiply the k3 KL term (beta > 0) by the importance ratio, which makes its gradient the unbiased "
            "reverse-KL gradient (DeepSeek-V3.2); changes the gradient even on-policy."
        ),
    )
    dynamic_sampling: bool = field(
        default=False,
        metadata=_help(
            "DAPO's dynamic sampling (verl: filter_groups): drop the groups whose rewards are all equal (zero "
            "advantage, nothing to learn) and generate for more prompts until the round holds only groups with "
            "reward variance, at most max_num_gen_batches generation batches per round; if still short, the round "
            "is completed with zero-variance groups. Logs dynamic_sampling/fill_rate and /num_gen_batches."
        ),
    )
    max_num_gen_batches: int = field(
        default=3,
        metadata=_help(
            "dynamic_sampling: the most generation batches (the round's own plus extra ones of the same size, for "
            "other prompts of the training set) generated for one round."
        ),
    )
    vllm_importance_sampling_cap: float | None = field(
        default=None, metadata=_help("Deprecated alias of vllm_importance_sampling_clip_max (overrides it when set).")
    )

    def __post_init__(self):
        self.scale_rewards = {True: "group", False: "none"}.get(self.scale_rewards, self.scale_rewards)
        super().__post_init__()
        self._check_choice("scale_rewards", self.scale_rewards, SCALE_REWARDS)
        self._check_choice(
            "multi_objective_aggregation", self.multi_objective_aggregation, MULTI_OBJECTIVE_AGGREGATIONS
        )
        self._check_choice(
            "vllm_importance_sampling_mode", self.vllm_importance_sampling_mode, IMPORTANCE_SAMPLING_MODES
        )
        cap = self.vllm_importance_sampling_cap
        if cap is not None:
            warnings.warn(
                "vllm_importance_sampling_cap is deprecated: use vllm_importance_sampling_clip_max.",
                FutureWarning,
                stacklevel=3,
            )
            self.vllm_importance_sampling_clip_max = cap
        self._check_loss_options()

    def _check_loss_options(self) -> None:
        low, high = self.vllm_importance_sampling_clip_min, self.vllm_importance_sampling_clip_max
        if low is not None and high is not None and low >= high:
            raise ConfigError(
                f"vllm_importance_sampling_clip_min={low} must be below vllm_importance_sampling_clip_max={high}."
            )
        if (
            self.vllm_importance_sampling_correction
            and self.vllm_importance_sampling_mode.endswith("truncate")
            and low is None
            and high is None
        ):
            raise ConfigError(
                f"vllm_importance_sampling_mode={self.vllm_importance_sampling_mode!r} truncates the "
                "ratio to [clip_min, clip_max], but both are None: set "
                "vllm_importance_sampling_clip_max (e.g. 3.0)."
            )
        if (
            self.loss_type == "vespo"
            and self.use_vllm
            and self.vllm_importance_sampling_correction
            and not self.vllm_importance_sampling_mode.startswith("token")
        ):
            raise ConfigError(
                "loss_type='vespo' folds the vLLM correction into its per-token weights: set "
                "vllm_importance_sampling_mode to 'token_truncate' or 'token_mask' (it is "
                f"{self.vllm_importance_sampling_mode!r})."
            )
        level = self.importance_sampling_level
        if self.loss_type == "luspo" and level != "sequence":
            warnings.warn(
                "loss_type='luspo' is defined with importance_sampling_level='sequence' (the paper's setup).",
                stacklevel=4,
            )
        if self.loss_type == "vespo" and level != "token":
            warnings.warn(
                "loss_type='vespo' builds its own sequence weight from token ratios: keep "
                "importance_sampling_level='token'.",
                stacklevel=4,
            )
        if level == "sequence" and self.loss_type in ("bnpo", "dr_grpo", "dapo", "cispo"):
            warnings.warn(
                f"importance_sampling_level='sequence' with loss_type={self.loss_type!r} sums token terms, "
                "which weights each completion by its length; GSPO uses loss_type='grpo'.",
                stacklevel=4,
            )
        if self.delta is not None and self.delta <= 1 + self.epsilon:
            raise ConfigError(
                f"delta={self.delta} caps the ratio for negative advantages and must exceed 1 + "
                f"epsilon = {1 + self.epsilon} (INTELLECT-2 uses 4), or be None (off)."
            )
        if not 0.0 <= self.top_entropy_quantile <= 1.0:
            raise ConfigError(
                f"top_entropy_quantile={self.top_entropy_quantile} must be in [0, 1] (1.0: every "
                "token; the paper uses 0.2)."
            )
        if self.off_policy_mask_threshold is not None and self.off_policy_mask_threshold <= 0:
            raise ConfigError(
                f"off_policy_mask_threshold={self.off_policy_mask_threshold} must be > 0 (e.g. 0.5), or None (off)."
            )
        if self.sapo_temperature_pos <= 0 or self.sapo_temperature_neg <= 0:
            raise ConfigError(
                f"sapo_temperature_pos={self.sapo_temperature_pos} and sapo_temperature_neg="
                f"{self.sapo_temperature_neg} must be > 0."
            )
        if self.dynamic_sampling and (self.max_num_gen_batches < 1 or self.num_generations < 2):
            raise ConfigError(
                f"dynamic_sampling=True needs max_num_gen_batches >= 1 (it is "
                f"{self.max_num_gen_batches}) and num_generations >= 2 (it is {self.num_generations})."
            )
        if self.use_adaptive_entropy and not (
            self.entropy_coef_min <= self.entropy_coef_max and self.entropy_coef_delta >= 0
        ):
            raise ConfigError(
                f"Adaptive entropy control needs entropy_coef_min ({self.entropy_coef_min}) <= "
                f"entropy_coef_max ({self.entropy_coef_max}) and entropy_coef_delta >= 0."
            )


def group_has_variance(group: torch.Tensor) -> bool:
    """Whether a group's scored rewards (NaN: no reward applies) are at least two and not all equal."""
    scored = group[~group.isnan()]
    return scored.numel() >= 2 and bool((scored != scored[0]).any())


class _Float32Head(nn.Linear):
    """An output layer computing its logits in float32, outside autocast (the class of a cast lm_head)."""

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        with torch.autocast(device_type=hidden_states.device.type, enabled=False):
            return nn.functional.linear(
                hidden_states.float(), self.weight.float(), None if self.bias is None else self.bias.float()
            )


def cast_output_layer_to_fp32(model) -> None:
    """Keeps `model`'s output layer in float32 and computes its logits in float32 (idempotent). Tied input
    embeddings share the weight, so they become float32 too and their outputs are cast back to the dtype the
    model had, leaving the rest of the forward unchanged."""
    head = model.get_output_embeddings()
    if isinstance(head, _Float32Head):
        return
    if type(head) is not nn.Linear:
        raise ConfigError(
            f"cast_lm_head_to_fp32=True needs a plain linear output layer, but this model's is "
            f"{type(head).__name__} (e.g. a PEFT adapter on lm_head): remove lm_head from the "
            "adapter's target_modules, or set cast_lm_head_to_fp32=False."
        )
    dtype = head.weight.dtype
    embeddings = model.get_input_embeddings()
    tied = embeddings is not None and embeddings.weight is head.weight
    head.float()
    head.__class__ = _Float32Head
    if tied and dtype != torch.float32:
        embeddings.register_forward_hook(lambda module, args, output: output.to(dtype))


class _EntropyControlState(TrainerCallback):
    """Saves the adaptive entropy coefficient in trainer_state.json of every checkpoint and restores it when
    training resumes (TrainerState.stateful_callbacks, read back at train begin)."""

    KEY = "GRPOAdaptiveEntropy"

    def __init__(self, controller: AdaptiveEntropyController) -> None:
        self.controller = controller

    def on_train_begin(self, args, state, control, **kwargs):
        saved = state.stateful_callbacks.get(self.KEY)
        if saved:
            self.controller.load_state(saved["attributes"])

    def on_step_end(self, args, state, control, **kwargs):
        state.stateful_callbacks[self.KEY] = {"args": {}, "attributes": self.controller.state()}


class GRPOTrainer(OnlineTrainer):
    """`GRPOTrainer(model, reward_funcs, args=GRPOConfig(...), train_dataset=..., peft_config=...)`."""

    _name = "GRPO"  # the method the model card names and cites (posttrain/model_card.py)

    config_class = GRPOConfig
    accepts_images = True  # image prompts (posttrain/trainers/online_vision.py)

    # -- advantages ----------------------------------------------------------------------------------------
    def compute_advantages(self, rewards: torch.Tensor, rollout: Rollout) -> Advantages:
        args = self.args
        if args.multi_objective_aggregation == "normalize_then_sum":
            per_function = self.accelerator.gather(rollout.per_function_rewards)
            weights = self.reward_scorer.weights.to(per_function.device)
            return Advantages(
                self.local_share(decoupled_advantages(per_function, weights, rollout.num_generations, _STD_EPS))
            )
        scale = args.scale_rewards
        per_group = "none" if scale == "batch" else scale
        advantages = groupwise_advantages(
            rewards, rollout.num_generations, lambda group: group_advantages(group, group.numel(), per_group)
        )
        if scale == "batch":
            advantages = advantages / (nanstd(rewards) + _STD_EPS)
        return Advantages(self.local_share(advantages))

    # -- dynamic sampling (DAPO) ----------------------------------------------------------------------------
    def sample_groups(self, rows, n, seeds, round_index) -> ScoredGroups:
        scored = super().sample_groups(rows, n, seeds, round_index)
        if not getattr(self.args, "dynamic_sampling", False) or self.rollout_mode != "train":
            return scored
        return self._keep_informative_groups(scored, n, seeds, round_index)

    def _keep_informative_groups(self, first: ScoredGroups, n: int, seeds: list[int], round_index: int):
        """DAPO's dynamic sampling: keeps the groups with reward variance and generates batches for other prompts
        (drawn from the training set with the round's seed) until the round is full of them or
        max_num_gen_batches batches were generated (all processes stop together); a round still short is
        completed with zero-variance groups, so its size never changes."""
        need, scored, batches = len(first.rows), first, 1
        kept, idle = [], []
        while True:
            varied = [g for g in range(len(scored.rows)) if group_has_variance(scored.rewards[g * n : (g + 1) * n])]
            kept.append(scored.groups(varied))
            idle.append(scored.groups([g for g in range(len(scored.rows)) if g not in varied]))
            found = sum(len(part.rows) for part in kept)
            short = torch.tensor([float(found < need)], device=self.accelerator.device)
            if batches >= self.args.max_num_gen_batches or not bool(self.accelerator.gather(short).any()):
                break
            batches += 1
            generator = torch.Generator().manual_seed(
                derive_seed(self.args.seed, round_index, batches, self.accelerator.process_index, 1)
            )
            indices = torch.randint(len(self.train_dataset), (need,), generator=generator).tolist()
            extra_seeds = [derive_seed(seed, batches) for seed in seeds]
            scored = OnlineTrainer.sample_groups(
                self, [self.train_dataset[i] for i in indices], n, extra_seeds, round_index
            )
            first.timings = {k: v + scored.timings.get(k, 0.0) for k, v in first.timings.items()}
        pool = ScoredGroups.concat(kept + idle)
        result = pool.groups(list(range(need)))
        result.timings = first.timings
        filled = torch.tensor([float(min(found, need)), float(need)], device=self.accelerator.device)
        filled = self.accelerator.gather(filled.unsqueeze(0)).sum(0)
        self._metrics["train"]["dynamic_sampling/fill_rate"].append(float(filled[0] / filled[1]))
        self._metrics["train"]["dynamic_sampling/num_gen_batches"].append(float(batches))
        return result

    # -- loss ----------------------------------------------------------------------------------------------
    def objective_options(self) -> dict:
        args = self.args
        return dict(
            loss_type=args.loss_type,
            delta=args.delta,
            sapo_temperature_pos=args.sapo_temperature_pos,
            sapo_temperature_neg=args.sapo_temperature_neg,
            vespo=VespoParams(args.vespo_k_pos, args.vespo_lambda_pos, args.vespo_k_neg, args.vespo_lambda_neg),
            kl_bias_correction=args.use_bias_correction_kl,
        )

    def sampler_ratio(self, trainer_logps, sampler_logps, mask):
        args = self.args
        return sampler_importance_weights(
            trainer_logps,
            sampler_logps,
            mask,
            args.vllm_importance_sampling_mode,
            args.vllm_importance_sampling_clip_min,
            args.vllm_importance_sampling_clip_max,
        )

    @property
    def trains_entropy(self) -> bool:
        """Whether the loss has an entropy bonus (then the entropy keeps its gradient)."""
        return self.args.entropy_coef != 0.0 or self.args.use_adaptive_entropy

    @property
    def entropy_controller(self) -> AdaptiveEntropyController | None:
        if not self.args.use_adaptive_entropy:
            return None
        callback = next((c for c in self.callback_handler.callbacks if isinstance(c, _EntropyControlState)), None)
        if callback is None:
            args = self.args
            callback = _EntropyControlState(
                AdaptiveEntropyController(
                    args.entropy_coef,
                    args.entropy_target,
                    args.entropy_coef_delta,
                    args.entropy_coef_min,
                    args.entropy_coef_max,
                )
            )
            self.add_callback(callback)
        return callback.controller

    def train(self, *args, **kwargs):
        if self.args.cast_lm_head_to_fp32:
            for model in (self.model, self.ref_model):
                if model is not None:
                    cast_output_layer_to_fp32(model)
        _ = self.entropy_controller  # registers its checkpoint callback before training starts (resume reads it)
        return super().train(*args, **kwargs)

    def policy_loss(self, inputs, logps, entropy=None, keep=None):
        """OnlineTrainer's policy loss with GRPO's token selection (top_entropy_quantile, off-policy masking)
        and entropy bonus."""
        args, mask = self.args, inputs["loss_mask"]
        selected = self.high_entropy_tokens(entropy, mask)
        if selected is not None:
            keep = selected.to(logps.dtype)
        if args.off_policy_mask_threshold is not None:
            behaviour = inputs.get("sampler_logps", inputs.get("old_logps", logps.detach()))
            off_policy = off_policy_sequence_mask(
                logps, behaviour, inputs["advantages"], mask, args.off_policy_mask_threshold
            )
            keep = off_policy if keep is None else keep * off_policy
        loss, metrics = super().policy_loss(inputs, logps, entropy, keep)
        if self.trains_entropy:
            loss, metrics = self._add_entropy_bonus(loss, metrics, entropy, mask if selected is None else selected)
        return loss, metrics

    def high_entropy_tokens(self, entropy: torch.Tensor, mask: torch.Tensor) -> torch.Tensor | None:
        """The tokens top_entropy_quantile keeps (ranked over all processes' valid tokens), or None for all."""
        if self.args.top_entropy_quantile >= 1.0:
            return None
        population = self._gather_valid(entropy.detach(), mask)
        return high_entropy_mask(entropy, mask, self.args.top_entropy_quantile, population)

    def _add_entropy_bonus(self, loss, metrics, entropy, tokens):
        """loss - coef x mean entropy over `tokens`, this micro-batch's share (TRL: the bonus is a per-micro-batch
        mean scaled for accumulation, the same for every loss_type); adapts the coefficient after each step."""
        tokens = tokens.to(entropy.dtype)
        steps = self.args.gradient_accumulation_steps if self.model.training else 1
        mean_entropy = (entropy * tokens).sum() / tokens.sum().clamp(min=1)
        controller = self.entropy_controller
        coef = self.args.entropy_coef if controller is None else controller.applied_coef()
        metrics["policy_loss"] = loss.detach() * steps / self.accelerator.num_processes
        loss = loss - coef * mean_entropy / steps
        if self.model.training:
            if controller is not None:
                self._observe_entropy(controller, entropy, tokens)
            if self.accelerator.sync_gradients:
                metrics["entropy_coef"] = self.args.entropy_coef if controller is None else controller.coef
        return loss, metrics

    def _observe_entropy(self, controller, entropy, tokens) -> None:
        """Sums the entropy of the step's micro-batches; at the step's last one, updates the coefficient with
        the mean over all of them and all processes."""
        stats = torch.stack([(entropy.detach() * tokens).sum(), tokens.sum()]).float()
        self._entropy_window = stats if getattr(self, "_entropy_window", None) is None else self._entropy_window + stats
        if self.accelerator.sync_gradients:
            total = self.accelerator.reduce(self._entropy_window, reduction="sum")
            controller.update((total[0] / total[1].clamp(min=1)).item())
            self._entropy_window = None

    def _gather_valid(self, values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """The valid entries of `values` on every process, concatenated."""
        local = values[mask.bool()].float()
        if self.accelerator.num_processes == 1:
            return local
        padded = self.accelerator.pad_across_processes(local, dim=0, pad_index=-1e9)
        gathered = self.accelerator.gather(padded)
        return gathered[gathered != -1e9]
