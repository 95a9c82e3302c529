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

import logging

import torch
from torch import nn
from transformers import TrainerCallback

from posttrain.errors import ConfigError
from posttrain.generation.base import derive_seed
from posttrain.losses.advantages import (
    AdaptiveEntropyController,
    decoupled_advantages,
    group_advantages,
)
from posttrain.losses.policy import POLICY_LOSSES, VespoParams
from posttrain.losses.reductions import masked_mean
from posttrain.losses.token_weights import (
    high_entropy_mask,
    off_policy_sequence_mask,
    sampler_importance_weights,
)
from posttrain.online.engine import (
    Advantages,
    OnlineTrainer,
    Rollout,
    ScoredGroups,
    groupwise_advantages,
    nanstd,
)
from posttrain.trainers.grpo_config import GRPOConfig

# group_advantages' own epsilon, used the same way when the batch std is taken over scored rewards only.
_STD_EPS = 1e-4


def group_has_variance(group: torch.Tensor) -> bool:
    """Whether a group's scored rewards (NaN: no reward applies) are at least two and not all equal."""
    scored = group[~group.isnan()]
    return scored.numel() >= 2 and bool((scored != scored[0]).any())


logger = logging.getLogger("posttrain")


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
    """Group Relative Policy Optimization: samples a group of completions per prompt, scores them with reward functions
    or models, and reinforces those above their group's mean.

    `GRPOTrainer(model, reward_funcs, args=GRPOConfig(...), train_dataset=..., peft_config=...)`.

    See docs/trainers/grpo.md.
    """

    _name = "GRPO"  # the method the model card names and cites (posttrain/training/model_card.py)

    config_class = GRPOConfig
    loss_reads_sampler_logps = True  # its policy_loss weighs each token by the sampler's log-prob
    accepts_images = True  # image prompts (posttrain/online/vision.py)

    # TRL's two mask helpers, public on its GRPOTrainer; the training step uses the same functions.
    def get_high_entropy_mask(self, entropies: torch.Tensor, mask: torch.Tensor, threshold: float) -> torch.Tensor:
        """True on the valid tokens whose entropy is at least the `threshold` quantile of the valid entropies of
        every process (threshold 0.8 keeps the top 20%)."""
        local = entropies[mask.bool()].float()  # entropies are >= 0: -1 marks the padding between processes
        gathered = self.accelerator.gather(self.accelerator.pad_across_processes(local, dim=0, pad_index=-1.0))
        return high_entropy_mask(entropies, mask, 1.0 - threshold, population=gathered[gathered >= 0])

    @staticmethod
    @torch.no_grad()
    def get_off_policy_mask(advantages, per_token_logps, sampling_per_token_logps, mask, off_policy_threshold):
        """[B, 1] 1.0 to keep a sequence, 0.0 to drop it: dropped when its advantage is negative and its mean
        log(pi_sampler / pi) over valid tokens exceeds `off_policy_threshold` (DeepSeek-V3.2)."""
        return off_policy_sequence_mask(
            per_token_logps, sampling_per_token_logps, advantages, mask, off_policy_threshold
        )

    def __init__(
        self,
        model,
        reward_funcs=None,
        args: GRPOConfig | None = None,
        train_dataset=None,
        eval_dataset=None,
        processing_class=None,
        reward_processing_classes=None,
        callbacks=None,
        optimizers=(None, None),
        quantization_config=None,
        peft_config=None,
        tools=None,
        rollout_func=None,
        environment_factory=None,
    ):
        """TRL's signature: `reward_funcs` may be left out when `environment_factory`'s environments give the reward
        (their `get_reward()`)."""
        loss = POLICY_LOSSES.get(getattr(args, "loss_type", None))
        if args is not None and args.importance_sampling_level == "sequence" and loss is not None and loss.sums_tokens:
            logger.warning(  # when the trainer is built, as TRL does, in TRL's words
                "importance_sampling_level='sequence' with loss_type=%r sums per-token contributions, which "
                "effectively weights each sequence by its completion length instead of the per-sequence objective; "
                "GSPO's setup is loss_type='grpo'.",
                args.loss_type,
            )
        super().__init__(
            model,
            reward_funcs,
            args,
            train_dataset,
            eval_dataset,
            processing_class,
            reward_processing_classes,
            callbacks,
            optimizers,
            quantization_config,
            peft_config,
            tools,
            rollout_func,
            environment_factory,
        )

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
    def sample_groups(self, rows, n, seeds, round_index, mode) -> ScoredGroups:
        scored = self.generate_and_score(rows, n, seeds, round_index, mode)
        if not getattr(self.args, "dynamic_sampling", False) or mode != "train":
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
            rows = [self.train_dataset[i] for i in indices]
            scored = self.generate_and_score(rows, n, extra_seeds, round_index, "train")
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
    def entropy_coef(self) -> float:
        """The entropy bonus's coefficient now (TRL's attribute): the adaptive controller's, else the config's."""
        controller = self.entropy_controller
        return self.args.entropy_coef if controller is None else controller.coef

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
        mean_entropy = masked_mean(entropy, tokens)
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
