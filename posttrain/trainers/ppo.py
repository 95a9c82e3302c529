"""Proximal Policy Optimization for language models (Schulman et al. 2017; the RLHF recipe of Ziegler et al.
2019 and Ouyang et al. 2022) on the online engine: generation, scoring and batching are the engine's.

Per completion token t the reward is -kl_coef * (log pi(y_t) - log pi_ref(y_t)), and the score of the whole
completion (reward model or reward functions) is added at its last token. A critic predicts the value of
every prefix; generalised advantage estimation (gamma, lam) turns rewards and values into per-token
advantages (whitened over the rollout) and returns (the critic's targets). Each rollout is then trained on
for num_ppo_epochs passes of num_mini_batches optimizer steps, with the clipped policy objective plus
vf_coef times the clipped value loss (minus entropy_coef times the entropy).

The critic is either a separate value model, by default a trainable copy of the reward model (the classic
setup: it starts out knowing what the reward model values), or a value head on the policy itself
(`use_value_head=True`, one network for both). The KL coefficient is fixed, or adapted after every rollout
towards target_kl (Ziegler et al. 2019).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import math
import os

import torch
from transformers import PreTrainedModel

from posttrain.errors import ConfigError
from posttrain.generation import create_generation_backend, stop_token_ids
from posttrain.losses.advantages import AdaptiveKLController, FixedKLController, gae, whiten
from posttrain.losses.policy import aggregate_loss, clipped_value_loss, entropy_from_logits, kl_estimate
from posttrain.losses.reductions import masked_mean
from posttrain.models.loading import load_causal_lm, load_sequence_classifier, load_tokenizer
from posttrain.models.reference import copy_model, freeze, reference_forward, unwrap
from posttrain.models.value_head import (  # VALUE_MODEL_DIR is re-exported
    VALUE_MODEL_DIR,
    AutoModelForCausalLMWithValueHead,
    CausalLMWithValueOutput,
    CausalLMWrapper,
    PolicyAndValueModel,
    check_value_model,
)
from posttrain.online.engine import Advantages, OnlineTrainer, Rollout
from posttrain.online.rollout import PROMPT_COLUMN, PROMPT_IDS_COLUMN
from posttrain.runtime.distributed import root_gathered
from posttrain.trainers.ppo_config import PPOConfig
from posttrain.trainers.ppo_trl import is_token_id_format, trl_reward_model, with_prompt_text

logger = logging.getLogger(__name__)


# -- the trainer -------------------------------------------------------------------------------------------------
class PPOTrainer(OnlineTrainer):
    """Proximal Policy Optimization for language models: a critic, GAE advantages, clipped policy and value losses and
    a KL penalty to a reference.

    `PPOTrainer(model, reward_funcs, args=PPOConfig(...), train_dataset=..., value_model=..., peft_config=...)`,
    or the last TRL PPOTrainer's keywords: `PPOTrainer(args=..., processing_class=..., model=..., ref_model=...,
    reward_model=..., train_dataset=..., value_model=..., data_collator=..., eval_dataset=...)`.

    `reward_funcs` (or TRL's `reward_model`): a reward model (object, name or path of a one-label sequence
    classifier), reward functions as for GRPO, or a list of both. `model` may be an
    `AutoModelForCausalLMWithValueHead` (its head is the critic). `value_model` (object, name or path) defaults
    to a copy of the first reward model, or to a value head on the policy when there is no reward model. The
    reference is `ref_model` if given, else a frozen copy of the policy, or, with `peft_config`, the policy with
    its adapter disabled (no second copy). `train_dataset` has a 'prompt' column, or (TRL's PPO format) token ids
    in 'input_ids', used as they are.

    See docs/trainers/ppo.md.
    """

    _name = "PPO"  # the method the model card names and cites (posttrain/training/model_card.py)

    loss_reads_sampler_logps = True  # its compute_loss weighs each token by the sampler's log-prob
    config_class = PPOConfig
    kl_in_loss = False

    def __init__(
        self,
        model=None,
        reward_funcs=None,
        args: PPOConfig | None = None,
        train_dataset=None,
        eval_dataset=None,
        processing_class=None,
        reward_processing_classes: list | None = None,
        peft_config=None,
        callbacks=None,
        optimizers=(None, None),
        value_model=None,
        value_processing_class=None,
        *,
        ref_model=None,
        reward_model=None,
        data_collator=None,
        tools=None,
        rollout_func=None,
        environment_factory=None,
    ):
        args = args or PPOConfig(output_dir="outputs/ppo")
        reward_funcs = trl_reward_model(model, reward_funcs, reward_model, ref_model, data_collator)
        head_model = model if isinstance(model, AutoModelForCausalLMWithValueHead) else None
        if any(is_token_id_format(d) for d in (train_dataset, eval_dataset)):
            tokenizer = processing_class or load_tokenizer(model if head_model is None else head_model.pretrained_model)
            train_dataset, eval_dataset = (with_prompt_text(d, tokenizer) for d in (train_dataset, eval_dataset))
        if (head_model is not None or args.use_value_head) and value_model is not None:
            raise ConfigError(
                "The policy has a value head (use_value_head=True or an "
                "AutoModelForCausalLMWithValueHead), so value_model must not be given too."
            )
        if head_model is not None:
            model = head_model.pretrained_model
        reward_funcs, reward_processing_classes = _load_reward_models(reward_funcs, reward_processing_classes)
        super().__init__(
            model,
            reward_funcs,
            args,
            train_dataset=train_dataset,
            eval_dataset=eval_dataset,
            processing_class=processing_class,
            reward_processing_classes=reward_processing_classes,
            peft_config=peft_config,
            callbacks=callbacks,
            optimizers=optimizers,
            tools=tools,
            rollout_func=rollout_func,
            environment_factory=environment_factory,
        )
        self._use_adapters(args)
        self._apply_stop_token(args)
        if ref_model is not None and args.beta > 0:
            self._use_ref_model(load_causal_lm(ref_model))
        self.model = self.model_wrapped = self._with_critic(
            head_model, value_model, value_processing_class, reward_funcs, reward_processing_classes
        )
        self.model.to(self.args.device)
        self.callback_handler.model = self.model
        self.kl_controller = (
            AdaptiveKLController(args.kl_coef, args.target_kl, args.kl_horizon)
            if args.target_kl is not None
            else FixedKLController(args.kl_coef)
        )
        self._rollouts = 0

    def prepare_dataset(self, dataset, tokenizer, args, name: str):
        """Token ids given in TRL's PPO format ('input_ids', kept as 'prompt_ids') are used as they are."""
        if PROMPT_IDS_COLUMN in dataset.column_names:
            self.conversational = False
            return dataset
        return super().prepare_dataset(dataset, tokenizer, args, name)

    def _use_adapters(self, args: PPOConfig) -> None:
        """model_adapter_name / ref_adapter_name: named adapters of a PEFT policy."""
        names = [n for n in (args.model_adapter_name, args.ref_adapter_name) if n is not None]
        if not names:
            return
        policy = unwrap(self.model)
        available = set(getattr(policy, "peft_config", {}) or {})
        missing = [n for n in names if n not in available]
        if missing:
            raise ConfigError(
                f"Adapters {missing} (model_adapter_name / ref_adapter_name) are not in the policy, "
                f"which has {sorted(available) or 'no PEFT adapters'}. Load them into the PeftModel "
                "(model.load_adapter(path, adapter_name=...)) or drop the setting."
            )
        if args.ref_adapter_name is not None and args.sync_ref_model:
            raise ConfigError(
                "ref_adapter_name makes an adapter of the policy the reference; sync_ref_model=True "
                "needs a separate reference model. Set one of them off."
            )
        policy.set_adapter(args.model_adapter_name or policy.active_adapter)

    def _use_ref_model(self, ref_model: PreTrainedModel) -> None:
        """TRL's ref_model: the given model, frozen, is the reference (also for sync_ref_model)."""
        vocab, ref_vocab = (m.get_input_embeddings().num_embeddings for m in (unwrap(self.model), ref_model))
        if vocab != ref_vocab:
            raise ConfigError(
                f"ref_model has {ref_vocab} token embeddings but the policy {vocab}: the reference must "
                "read the policy's token ids. Pass a reference with the policy's tokenizer."
            )
        old, self.ref_model = self.ref_model, self.accelerator.prepare_model(freeze(ref_model), evaluation_mode=True)
        for callback in self.callback_handler.callbacks:
            if getattr(callback, "ref_model", None) is old and old is not None:
                callback.ref_model = self.ref_model

    def _apply_stop_token(self, args: PPOConfig) -> None:
        """stop_token_id ends completions too: the generation backend is rebuilt with it among the stop tokens."""
        if args.stop_token_id is None or args.stop_token_id in stop_token_ids(self.processing_class, self.model):
            return
        if args.use_vllm:
            raise ConfigError(
                f"stop_token_id={args.stop_token_id} is not among the stop tokens of the tokenizer and "
                "model, and the vLLM backend reads those when it starts; set "
                "model.generation_config.eos_token_id instead."
            )
        config = unwrap(self.model).generation_config
        config.eos_token_id = [*stop_token_ids(self.processing_class, self.model), args.stop_token_id]
        self.generation_backend = create_generation_backend(self.model, self.processing_class, args)

    def _with_critic(self, head_model, value_model, value_processing_class, reward_funcs, reward_processing_classes):
        """The policy (self.model, already PEFT-wrapped if asked) together with its critic."""
        policy, tokenizer = self.model, self.processing_class
        if head_model is not None:
            head_model.pretrained_model = policy
            return head_model
        if self.args.use_value_head:
            return AutoModelForCausalLMWithValueHead(policy)
        source = "value_model"
        if value_model is None:
            reward_models = [i for i, f in enumerate(reward_funcs) if isinstance(f, PreTrainedModel)]
            if not reward_models:
                logger.info("No reward model to initialise the value model from: using a value head on the policy.")
                return AutoModelForCausalLMWithValueHead(policy)
            index = reward_models[0]
            source = f"a copy of the reward model reward_funcs[{index}]"
            value_model = copy_model(reward_funcs[index]).requires_grad_(True)  # ZeRO-3: gathered weights
            value_processing_class = reward_processing_classes[index]
        elif isinstance(value_model, str):
            value_processing_class = load_tokenizer(value_model, value_processing_class)
            value_model = load_sequence_classifier(value_model, 1, self.args.model_init_kwargs)
        else:
            value_model = load_sequence_classifier(value_model, 1)  # checks the class and num_labels
        check_value_model(value_model, value_processing_class, unwrap(policy), tokenizer, source)
        return PolicyAndValueModel(policy, value_model)

    # -- rollout ---------------------------------------------------------------------------------------------
    def policy_tensors(self, rollout: Rollout) -> dict[str, torch.Tensor]:
        """Log-probs and values of the policy before the update (one forward), and the reference's log-probs,
        in chunks of local_rollout_forward_batch_size completions."""
        logps = torch.zeros(rollout.completion_ids.shape, device=rollout.completion_ids.device)
        values = torch.zeros_like(logps)
        size = self.args.local_rollout_forward_batch_size
        model = unwrap(self.model)
        with torch.no_grad():
            for start in range(0, len(rollout), size):
                batch = rollout.batch(start, start + size)
                chunk, _, outputs = self.completion_logps(model, batch, return_outputs=True)
                logps[start : start + size, : chunk.shape[1]] = chunk
                values[start : start + size, : chunk.shape[1]] = _completion_values(outputs, chunk.shape[1])
        mask = rollout.model_mask.bool()
        out = {"old_logps": torch.where(mask, logps, 0.0), "old_values": torch.where(mask, values, 0.0)}
        if self.args.beta > 0:
            with self._reference() as lm, torch.no_grad():
                ref_logps = torch.zeros_like(logps)
                for start in range(0, len(rollout), size):
                    chunk, _ = self.completion_logps(lm, rollout.batch(start, start + size))
                    ref_logps[start : start + size, : chunk.shape[1]] = chunk
                out["ref_logps"] = ref_logps
        if unwrap(self.model).training:  # not an evaluation rollout
            self._rollouts += 1
            self._log_sample_generations()
        return out

    @contextlib.contextmanager
    def _reference(self):
        """The reference LM: the policy with ref_adapter_name active, else the engine's reference (a separate
        model, or the PEFT policy with its adapter disabled); the critic is not needed."""
        name = self.args.ref_adapter_name
        if name is None:
            with reference_forward(self.model, self.ref_model) as reference:
                yield reference.pretrained_model if isinstance(reference, CausalLMWrapper) else reference
            return
        wrapper = unwrap(self.model)
        policy = wrapper.pretrained_model if isinstance(wrapper, CausalLMWrapper) else wrapper
        trained, was_training = policy.active_adapter, policy.training
        policy.set_adapter(name)
        policy.eval()
        try:
            yield policy
        finally:
            policy.set_adapter(trained)  # PEFT makes the active adapter the trainable one again
            policy.train(was_training)

    def _log_sample_generations(self) -> None:
        """TRL's num_sample_generations: that many times in training, near-greedy completions (temperature 0.01)
        of the first eval batch are scored, logged and appended to output_dir/sample_generations.jsonl."""
        args, data = self.args, self.eval_dataset
        rollouts = max(1, math.ceil(self.state.max_steps / (args.num_iterations * args.optimizer_steps_per_generation)))
        if (
            args.num_sample_generations == 0
            or data is None
            or isinstance(data, dict)
            or (self._rollouts - 1) % max(1, rollouts // args.num_sample_generations)
        ):
            return
        data = data if PROMPT_IDS_COLUMN in (data.column_names or ()) else self._prepared_eval(data)
        rows = [data[i] for i in range(min(len(data), args.per_device_eval_batch_size))]
        with root_gathered(self.model):  # FSDP2: the wrapper's root weights are sharded otherwise
            completions = self.generation_backend.generate(
                [r[PROMPT_IDS_COLUMN] for r in rows],
                1,
                dataclasses.replace(self.sampling, temperature=0.01),
                seed=args.seed,
            )
        texts = [self.processing_class.decode(c.token_ids, skip_special_tokens=True) for c in completions]
        _, scores = self.reward_scorer(
            [r[PROMPT_COLUMN] for r in rows],
            [[{"role": "assistant", "content": t}] for t in texts] if self.conversational else texts,
            [c.token_ids for c in completions],
            {c: [r[c] for r in rows] for c in self.reward_columns},
            trainer_state=self.state,
        )
        if self.is_world_process_zero():
            os.makedirs(args.output_dir, exist_ok=True)
            records = [
                {"step": self.state.global_step, "prompt": r[PROMPT_COLUMN], "completion": t, "score": float(x)}
                for r, t, x in zip(rows, texts, scores.tolist())
            ]
            with open(os.path.join(args.output_dir, "sample_generations.jsonl"), "a") as f:
                f.writelines(json.dumps(record) + "\n" for record in records)
            logger.info("Sample generations at step %d: %s", self.state.global_step, records)

    def compute_advantages(self, rewards: torch.Tensor, rollout: Rollout) -> Advantages:
        """Per-token rewards (KL penalty, score at the last token) -> GAE advantages [N, T] and the returns.

        A completion no reward function applies to is left out of training (its loss mask is cleared).
        """
        args = self.args
        mask = rollout.model_mask.bool()
        scores = self.local_share(rewards).clone()
        if args.missing_eos_penalty is not None:
            scores[~rollout.finished] -= args.missing_eos_penalty
        unscored = scores.isnan()
        loss_mask = rollout.loss_mask.masked_fill(unscored.unsqueeze(1), 0)
        scores = scores.nan_to_num(0.0)

        kl = torch.zeros_like(rollout.old_logps)
        if args.beta > 0:
            kl = torch.where(mask, kl_estimate(rollout.old_logps, rollout.ref_logps, args.kl_estimator), 0.0)
        kl_coef = self.kl_controller.value
        token_rewards = -kl_coef * kl
        last = mask.long().cumsum(1).argmax(1)  # the last token the policy sampled
        token_rewards[torch.arange(len(rollout)), last] += scores
        if args.whiten_rewards:
            token_rewards = self._whiten_over_processes(token_rewards, mask, shift_mean=False)
        old_values = rollout.old_values
        advantages, returns = gae(token_rewards, old_values, mask, args.gamma, args.lam)
        trained = loss_mask.bool()
        if args.whiten_advantages:
            advantages = self._whiten_over_processes(advantages, trained)

        gather = self.accelerator.gather
        scored = ~gather(unscored)
        sequence_kl = gather(kl.sum(1))[scored]
        non_score = -kl_coef * sequence_kl
        all_scores = gather(scores)[scored]
        flat_returns, flat_values = self._gather_tokens(returns, trained), self._gather_tokens(old_values, trained)
        metrics = {
            "objective/scores": all_scores.mean(),
            "objective/kl": sequence_kl.mean(),
            "objective/non_score_reward": non_score.mean(),
            "objective/rlhf_reward": (all_scores + non_score).mean(),
            "kl_coef": kl_coef,
            "value/explained_variance": _explained_variance(flat_values, flat_returns),
        }
        self.kl_controller.update(float(sequence_kl.mean()), args.generation_batch_size)
        return Advantages(advantages, returns=returns, loss_mask=loss_mask, metrics=metrics)

    def _gather_tokens(self, values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """The entries of [N, T] `values` where `mask` is set, over all processes (1-D)."""
        pad = self.accelerator.pad_across_processes
        values, mask = self.accelerator.gather((pad(values, dim=1), pad(mask, dim=1)))
        return values[mask]

    def _whiten_over_processes(self, values: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True) -> torch.Tensor:
        """`whiten` with the mean and variance of the masked tokens of all processes."""
        pad = self.accelerator.pad_across_processes
        all_values, all_mask = self.accelerator.gather((pad(values, dim=1), pad(mask, dim=1)))
        return self.local_share(whiten(all_values, all_mask, shift_mean=shift_mean))[:, : values.shape[1]]

    # -- update ----------------------------------------------------------------------------------------------
    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        """Clipped policy loss + vf_coef x clipped value loss (- entropy_coef x entropy), each aggregated over the
        optimizer step like the engine's policy loss."""
        args, mask = self.args, inputs["loss_mask"]
        logps, entropy, outputs = self.completion_logps(model, inputs, with_entropy=True, return_outputs=True)
        width = logps.shape[1]
        policy_loss, policy_metrics = self.policy_loss(inputs, logps)
        values = _completion_values(outputs, width)
        old_values, returns = inputs["old_values"], inputs["returns"]
        value_loss = self._aggregate(
            clipped_value_loss(values, old_values, returns, mask, args.cliprange_value), inputs
        )
        loss = policy_loss + args.vf_coef * value_loss
        if args.entropy_coef > 0:  # the bonus needs the entropy's gradient
            entropy = entropy_from_logits(outputs.logits[:, :-1] / args.logps_temperature)
            loss = loss - args.entropy_coef * self._aggregate(entropy, inputs)

        weights = mask.to(logps.dtype)
        with torch.no_grad():
            clipped_values = old_values + (values - old_values).clamp(-args.cliprange_value, args.cliprange_value)
            value_clipped = (clipped_values - returns) ** 2 > (values - returns) ** 2
            log_ratio = logps - inputs["old_logps"]
            # A micro-batch's loss is its share of the optimizer step's: x accumulation steps, the window's mean
            # is the mean optimizer-step loss.
            steps = args.gradient_accumulation_steps
            self.record_metrics(
                {
                    **policy_metrics,
                    "loss/policy": policy_loss * steps,
                    "loss/value": value_loss * steps,
                    "value/clipfrac": masked_mean(value_clipped.to(weights.dtype), weights),
                    "policy/approxkl": masked_mean(0.5 * log_ratio**2, weights),
                    "entropy": masked_mean(entropy.detach(), weights),
                }
            )
        return (loss, None) if return_outputs else loss

    def _aggregate(self, per_token: torch.Tensor, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
        """A per-token loss reduced like the policy loss: this micro-batch's share of the optimizer step."""
        loss = aggregate_loss(
            per_token,
            inputs["loss_mask"],
            self.args.loss_type,
            total_sequences=inputs["total_sequences"],
            total_tokens=inputs["total_tokens"],
            max_completion_length=self.args.max_completion_length,
        )
        return loss * self.accelerator.num_processes

    # -- checkpoints ----------------------------------------------------------------------------------------
    def checkpoint_state(self) -> dict:
        """The KL coefficient (adaptive KL moves it) and the rollout count, beside the engine's state (which
        carries the rollout when the checkpoint falls inside its epochs or mini-batches)."""
        own = {"kl_coef": self.kl_controller.value, "rollouts": self._rollouts}
        return {**super().checkpoint_state(), "ppo": own}

    def load_checkpoint_state(self, state: dict) -> None:
        state = dict(state)
        own = state.pop("ppo", None)
        super().load_checkpoint_state(state)
        if own is not None:
            self.kl_controller.value, self._rollouts = own["kl_coef"], own["rollouts"]

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model=None) -> None:
        """A checkpoint of the policy and its critic, as `_save` writes it: the policy (full weights or PEFT
        adapter) at the top, the value head's file or the value model's folder beside it."""
        wrapper = self.model if model is None else model
        if not isinstance(wrapper, CausalLMWrapper):
            return super()._load_from_checkpoint(resume_from_checkpoint, model)
        super()._load_from_checkpoint(resume_from_checkpoint, wrapper.pretrained_model)
        if isinstance(wrapper, PolicyAndValueModel):
            super()._load_from_checkpoint(os.path.join(resume_from_checkpoint, VALUE_MODEL_DIR), wrapper.value_model)
        else:
            wrapper.load_value_head(resume_from_checkpoint)

    def _load_best_model(self) -> None:
        """load_best_model_at_end: the best checkpoint's policy and critic."""
        if not isinstance(self.model, CausalLMWrapper):
            return super()._load_best_model()
        self._load_from_checkpoint(self.state.best_model_checkpoint)

    def _save(self, output_dir: str | None = None, state_dict: dict | None = None) -> None:
        """The policy loadable as a causal LM in output_dir, with the critic beside it (value head or value model)."""
        output_dir = output_dir or self.args.output_dir
        self.accelerator.unwrap_model(self.model).save_pretrained(output_dir, is_main_process=self.args.should_save)
        if self.args.should_save:
            self.processing_class.save_pretrained(output_dir)


def _load_reward_models(reward_funcs, reward_processing_classes: list | None) -> tuple[list, list]:
    """reward_funcs with reward models given by name loaded (with their tokenizers), so that the default value
    model can start as a copy of one."""
    funcs = list(reward_funcs) if isinstance(reward_funcs, (list, tuple)) else [reward_funcs]
    classes = list(reward_processing_classes) if reward_processing_classes is not None else [None] * len(funcs)
    if len(classes) != len(funcs):
        raise ConfigError(
            f"reward_processing_classes has {len(classes)} entries but there are {len(funcs)} reward "
            "functions; give one per reward function, in the same order."
        )
    for i, func in enumerate(funcs):
        if isinstance(func, (str, PreTrainedModel)):
            classes[i] = load_tokenizer(func, classes[i])
            funcs[i] = load_sequence_classifier(func, num_labels=1, tokenizer=classes[i])
    return funcs, classes


def _completion_values(outputs: CausalLMWithValueOutput, width: int) -> torch.Tensor:
    """The values [B, width] of the positions that predict the completion tokens (as the kept logits are)."""
    return outputs.values[:, -(width + 1) : -1]


def _explained_variance(values: torch.Tensor, returns: torch.Tensor) -> float:
    """1 - Var(returns - values) / Var(returns): 1 for a perfect critic, 0 for a constant one (NaN if undefined)."""
    if returns.numel() < 2 or returns.var() == 0:
        return float("nan")
    return float(1 - (returns - values).var() / returns.var())
