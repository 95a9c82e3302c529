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

import copy
import logging
import os
from dataclasses import dataclass, field, fields
from typing import Any, ClassVar

import torch
from torch import nn
from transformers import PreTrainedModel

from ..errors import ConfigError
from ..losses.advantages import AdaptiveKLController, FixedKLController, gae, whiten
from ..losses.policy import aggregate_loss, clipped_value_loss, entropy_from_logits
from ..models.loading import load_sequence_classifier, load_tokenizer
from ..models.reference import reference_forward, unwrap
from ..models.value_head import AutoModelForCausalLMWithValueHead, CausalLMWithValueOutput, CausalLMWrapper
from .online import OnlineConfig, OnlineTrainer, Rollout

logger = logging.getLogger(__name__)

VALUE_MODEL_DIR = "value_model"

# PPO's names for engine settings: PPOConfig(num_ppo_epochs=4) is OnlineConfig(num_iterations=4), etc.
_PPO_NAMES = {"num_ppo_epochs": "num_iterations", "cliprange": "epsilon", "kl_coef": "beta"}


@dataclass
class PPOConfig(OnlineConfig):
    """OnlineConfig with PPO's settings. One rollout is generation_batch_size completions (one per prompt
    by default); it is split into num_mini_batches mini-batches of per_device_train_batch_size x
    gradient_accumulation_steps x processes completions, one optimizer step each, and passed over
    num_ppo_epochs times."""

    method: ClassVar[str] = "PPO"

    num_generations: int = field(default=1, metadata={"help": "Completions sampled per prompt."})
    num_ppo_epochs: int = field(default=4, metadata={"help": "Passes over each rollout (num_iterations in the "
                                                             "engine's terms)."})
    num_mini_batches: int | None = field(
        default=None, metadata={"help": "Optimizer steps (mini-batches) per rollout, each of per_device_train_"
                                        "batch_size x gradient_accumulation_steps x processes completions "
                                        "(steps_per_generation in the engine's terms; default 1, or derived from "
                                        "generation_batch_size)."})
    cliprange: float = field(default=0.2, metadata={"help": "Clip range of the policy ratio (epsilon)."})
    cliprange_value: float = field(
        default=0.2, metadata={"help": "A new value may move at most this far from the rollout's value before "
                                       "its loss stops improving."})
    vf_coef: float = field(default=0.1, metadata={"help": "Weight of the value loss."})
    entropy_coef: float = field(default=0.0, metadata={"help": "Weight of the entropy bonus (0: none)."})
    kl_coef: float = field(
        default=0.05, metadata={"help": "(Initial) KL coefficient: kl_coef x (log pi - log pi_ref) is subtracted "
                                        "from every token's reward (beta in the engine's terms; 0: no reference "
                                        "model)."})
    target_kl: float | None = field(
        default=None, metadata={"help": "Adaptive KL (Ziegler et al. 2019): after every rollout kl_coef moves "
                                        "towards keeping a completion's summed KL at target_kl. None: kl_coef "
                                        "stays fixed."})
    kl_horizon: float = field(
        default=10000, metadata={"help": "Adaptive KL horizon: kl_coef changes by at most 20% per horizon "
                                         "completions."})
    gamma: float = field(default=1.0, metadata={"help": "Discount factor of GAE, in (0, 1]."})
    lam: float = field(default=0.95, metadata={"help": "GAE lambda, in (0, 1]: 1 is Monte-Carlo returns, lower "
                                                       "trusts the critic more."})
    whiten_advantages: bool = field(
        default=True, metadata={"help": "Scale the advantages of each rollout to mean 0 and std 1."})
    missing_eos_penalty: float | None = field(
        default=None, metadata={"help": "Subtract this from the score of a completion cut at "
                                        "max_completion_length (without an EOS token)."})
    use_value_head: bool = field(
        default=False, metadata={"help": "Put a value head on the policy instead of training a separate value "
                                         "model (less memory; the two losses share the network)."})
    # The engine's names for three of the settings above, with PPO's defaults; set either name.
    num_iterations: int = field(default=4, metadata={"help": "Same as num_ppo_epochs."})
    epsilon: float = field(default=0.2, metadata={"help": "Same as cliprange."})
    beta: float = field(default=0.05, metadata={"help": "Same as kl_coef."})

    def __post_init__(self):
        self._merge_ppo_names()
        super().__post_init__()
        for name in ("gamma", "lam"):
            value = getattr(self, name)
            if not 0 < value <= 1:
                raise ConfigError(f"{name}={value} must be in (0, 1] (typical: gamma=1.0, lam=0.95).")
        for name in ("cliprange_value", "kl_horizon"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name}={getattr(self, name)} must be > 0.")
        for name in ("vf_coef", "entropy_coef"):
            if getattr(self, name) < 0:
                raise ConfigError(f"{name}={getattr(self, name)} must be >= 0 (0 switches the term off).")
        if self.target_kl is not None and (self.target_kl <= 0 or self.kl_coef == 0):
            raise ConfigError(f"target_kl={self.target_kl} adapts kl_coef={self.kl_coef}: it needs target_kl > 0 "
                              "and kl_coef > 0 (or target_kl=None for a fixed coefficient).")

    def _merge_ppo_names(self) -> None:
        """Either name of a setting may be changed from the default (`cliprange` or `epsilon`, ...); changing both
        to different values fails."""
        defaults = {f.name: f.default for f in fields(self)}
        for ppo_name, engine_name in _PPO_NAMES.items():
            ppo_value, engine_value = getattr(self, ppo_name), getattr(self, engine_name)
            engine_changed = engine_value != defaults[engine_name]
            if engine_changed and ppo_value != defaults[ppo_name] and engine_value != ppo_value:
                raise ConfigError(f"{ppo_name}={ppo_value} and {engine_name}={engine_value} are the same setting "
                                  f"(PPO calls {engine_name} {ppo_name}); set only {ppo_name}.")
            value = engine_value if engine_changed else ppo_value
            setattr(self, ppo_name, value)
            setattr(self, engine_name, value)

    def _resolve_generation_batch(self) -> None:
        """num_mini_batches is steps_per_generation; checks it against generation_batch_size in PPO's terms."""
        if self.num_mini_batches is not None:
            if self.num_mini_batches < 1:
                raise ConfigError(f"num_mini_batches={self.num_mini_batches} must be at least 1.")
            if self.steps_per_generation not in (None, self.num_mini_batches):
                raise ConfigError(f"num_mini_batches={self.num_mini_batches} and steps_per_generation="
                                  f"{self.steps_per_generation} are the same setting; set only num_mini_batches.")
            mini_batch = self.per_device_train_batch_size * self.gradient_accumulation_steps * self.world_size
            if self.generation_batch_size is not None and self.generation_batch_size != self.num_mini_batches * mini_batch:
                fits = (f" or num_mini_batches={self.generation_batch_size // mini_batch}"
                        if self.generation_batch_size % mini_batch == 0 else "")
                raise ConfigError(
                    f"generation_batch_size={self.generation_batch_size} (the rollout) does not split into "
                    f"num_mini_batches={self.num_mini_batches} mini-batches of per_device_train_batch_size "
                    f"({self.per_device_train_batch_size}) x gradient_accumulation_steps "
                    f"({self.gradient_accumulation_steps}) x processes ({self.world_size}) = {mini_batch} "
                    f"completions. Set generation_batch_size={self.num_mini_batches * mini_batch}{fits}.")
            self.steps_per_generation = self.num_mini_batches
        super()._resolve_generation_batch()
        self.num_mini_batches = self.steps_per_generation


# -- the critic ------------------------------------------------------------------------------------------------
class PolicyAndValueModel(CausalLMWrapper):
    """The policy and a separate value model (a sequence classifier) as the one module the Trainer optimises.

    The value of every position is the classifier's score head applied to its backbone's hidden state there
    (the classifier itself would keep only the last token's).
    """

    def __init__(self, policy: nn.Module, value_model: PreTrainedModel) -> None:
        super().__init__()
        self.pretrained_model = policy
        self.value_model = value_model

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None, **kwargs: Any) -> CausalLMWithValueOutput:
        logits = self.pretrained_model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                                       **kwargs).logits
        backbone = getattr(self.value_model, self.value_model.base_model_prefix)
        hidden = backbone(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                          use_cache=False).last_hidden_state
        return CausalLMWithValueOutput(logits=logits, values=self.value_model.score(hidden).squeeze(-1).float())

    def save_pretrained(self, save_directory: str, **kwargs: Any) -> None:
        """The policy in `save_directory` (loadable as a causal LM as is), the value model in its `value_model/`."""
        kwargs.pop("state_dict", None)  # each model saves its own weights
        self.pretrained_model.save_pretrained(save_directory, **kwargs)
        self.value_model.save_pretrained(os.path.join(save_directory, VALUE_MODEL_DIR), **kwargs)


def _check_value_model(value_model: PreTrainedModel, value_tokenizer, policy, tokenizer, source: str) -> None:
    """The value model reads the policy's token ids, so both must have the same vocabulary and a per-token head."""
    if not isinstance(getattr(value_model, "score", None), nn.Linear):
        raise ConfigError(f"The value model ({source}, a {type(value_model).__name__}) has no per-token `score` "
                          "head; use a causal-LM-based sequence classifier (e.g. a reward model trained with "
                          "RewardTrainer) or set use_value_head=True.")
    same = (value_tokenizer.get_vocab() == tokenizer.get_vocab() if value_tokenizer is not None else
            value_model.get_input_embeddings().num_embeddings == policy.get_input_embeddings().num_embeddings)
    if not same:
        raise ConfigError(
            f"The value model ({source}) has a different vocabulary from the policy, and it must read the "
            "policy's token ids (no mapping between tokenizers is done). Pass a value_model built on the "
            "policy's tokenizer (e.g. a reward model trained from the policy), or set use_value_head=True.")


# -- the trainer -------------------------------------------------------------------------------------------------
class PPOTrainer(OnlineTrainer):
    """`PPOTrainer(model, reward_funcs, args=PPOConfig(...), train_dataset=..., value_model=..., peft_config=...)`.

    `reward_funcs`: a reward model (object, name or path of a one-label sequence classifier), reward
    functions as for GRPO, or a list of both. `model` may be an `AutoModelForCausalLMWithValueHead` (its head
    is the critic). `value_model` (object, name or path) defaults to a copy of the first reward model, or to a
    value head on the policy when there is no reward model. The reference is a frozen copy of the policy,
    or, with `peft_config`, the policy with its adapter disabled (no second copy).
    """

    config_class = PPOConfig
    kl_in_loss = False

    def __init__(self, model, reward_funcs, args: PPOConfig | None = None, train_dataset=None, eval_dataset=None,
                 processing_class=None, reward_processing_classes: list | None = None, peft_config=None,
                 callbacks=None, optimizers=(None, None), value_model=None, value_processing_class=None):
        args = args or PPOConfig(output_dir="outputs/ppo")
        head_model = model if isinstance(model, AutoModelForCausalLMWithValueHead) else None
        if (head_model is not None or args.use_value_head) and value_model is not None:
            raise ConfigError("The policy has a value head (use_value_head=True or an "
                              "AutoModelForCausalLMWithValueHead), so value_model must not be given too.")
        if head_model is not None:
            model = head_model.pretrained_model
        reward_funcs, reward_processing_classes = _load_reward_models(reward_funcs, reward_processing_classes)
        super().__init__(model, reward_funcs, args, train_dataset, eval_dataset, processing_class,
                         reward_processing_classes, peft_config, callbacks, optimizers)
        self.model = self.model_wrapped = self._with_critic(head_model, value_model, value_processing_class,
                                                            reward_funcs, reward_processing_classes)
        self.model.to(self.args.device)
        self.callback_handler.model = self.model
        self.kl_controller = (AdaptiveKLController(args.kl_coef, args.target_kl, args.kl_horizon)
                              if args.target_kl is not None else FixedKLController(args.kl_coef))

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
            value_model = copy.deepcopy(reward_funcs[index]).requires_grad_(True)
            value_processing_class = reward_processing_classes[index]
        elif isinstance(value_model, str):
            value_processing_class = load_tokenizer(value_model, value_processing_class)
            value_model = load_sequence_classifier(value_model, 1, self.args.model_init_kwargs)
        else:
            value_model = load_sequence_classifier(value_model, 1)  # checks the class and num_labels
        _check_value_model(value_model, value_processing_class, unwrap(policy), tokenizer, source)
        return PolicyAndValueModel(policy, value_model)

    # -- rollout ---------------------------------------------------------------------------------------------
    def attach_rollout_tensors(self, rollout: Rollout) -> None:
        """Log-probs and values of the policy before the update (one forward), and the reference's log-probs."""
        logps = torch.zeros(rollout.completion_ids.shape, device=rollout.completion_ids.device)
        values = torch.zeros_like(logps)
        size = self.args.per_device_train_batch_size
        model = unwrap(self.model)
        with torch.no_grad():
            for start in range(0, len(rollout), size):
                batch = rollout.batch(start, start + size)
                chunk, _, outputs = self.completion_logps(model, batch, return_outputs=True)
                logps[start:start + size, :chunk.shape[1]] = chunk
                values[start:start + size, :chunk.shape[1]] = _completion_values(outputs, chunk.shape[1])
        mask = rollout.completion_mask.bool()
        rollout.tensors["old_logps"] = torch.where(mask, logps, 0.0)
        rollout.tensors["old_values"] = torch.where(mask, values, 0.0)
        if self.args.beta > 0:
            with reference_forward(self.model, self.ref_model) as reference:
                # With PEFT the reference is the policy's own LM with its adapter off: the critic is not needed.
                lm = reference.pretrained_model if isinstance(reference, CausalLMWrapper) else reference
                rollout.tensors["ref_logps"] = self._rollout_logps(rollout, lm)

    def compute_advantages(self, rewards: torch.Tensor, rollout: Rollout) -> torch.Tensor:
        """Per-token rewards (KL penalty, score at the last token) -> GAE advantages [N, T]; stores the returns.

        A completion no reward function applies to is left out of training (its loss mask is cleared).
        """
        args = self.args
        mask = rollout.completion_mask.bool()
        scores = self.local_share(rewards).clone()
        if args.missing_eos_penalty is not None:
            scores[~rollout.finished] -= args.missing_eos_penalty
        unscored = scores.isnan()
        rollout.loss_mask = rollout.loss_mask.masked_fill(unscored.unsqueeze(1), 0)  # may share completion_mask
        scores = scores.nan_to_num(0.0)

        kl = torch.zeros_like(rollout.tensors["old_logps"])
        if args.beta > 0:
            kl = torch.where(mask, rollout.tensors["old_logps"] - rollout.tensors["ref_logps"], 0.0)
        kl_coef = self.kl_controller.value
        token_rewards = -kl_coef * kl
        last = mask.sum(1) - 1
        token_rewards[torch.arange(len(rollout)), last] += scores
        old_values = rollout.tensors["old_values"]
        advantages, returns = gae(token_rewards, old_values, mask, args.gamma, args.lam)
        rollout.tensors["returns"] = returns
        trained = rollout.loss_mask.bool()
        if args.whiten_advantages:
            advantages = self._whiten_over_processes(advantages, trained)

        gather = self.accelerator.gather
        scored = ~gather(unscored)
        sequence_kl = gather(kl.sum(1))[scored]
        non_score = -kl_coef * sequence_kl
        all_scores = gather(scores)[scored]
        flat_returns, flat_values = self._gather_tokens(returns, trained), self._gather_tokens(old_values, trained)
        metrics = {
            "objective/scores": all_scores.mean(), "objective/kl": sequence_kl.mean(),
            "objective/non_score_reward": non_score.mean(), "objective/rlhf_reward": (all_scores + non_score).mean(),
            "kl_coef": kl_coef, "value/explained_variance": _explained_variance(flat_values, flat_returns),
        }
        for key, value in metrics.items():
            self._metrics["train"][key].append(float(value))
        self.kl_controller.update(float(sequence_kl.mean()), args.generation_batch_size)
        return advantages

    def _gather_tokens(self, values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """The entries of [N, T] `values` where `mask` is set, over all processes (1-D)."""
        pad = self.accelerator.pad_across_processes
        values, mask = self.accelerator.gather((pad(values, dim=1), pad(mask, dim=1)))
        return values[mask]

    def _whiten_over_processes(self, advantages: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """`whiten` with the mean and variance of the trained tokens of all processes."""
        pad = self.accelerator.pad_across_processes
        all_advantages, all_mask = self.accelerator.gather((pad(advantages, dim=1), pad(mask, dim=1)))
        return self.local_share(whiten(all_advantages, all_mask))[:, :advantages.shape[1]]

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
        value_loss = self._aggregate(clipped_value_loss(values, old_values, returns, mask, args.cliprange_value), inputs)
        loss = policy_loss + args.vf_coef * value_loss
        if args.entropy_coef > 0:  # the bonus needs the entropy's gradient
            entropy = entropy_from_logits(outputs.logits[:, :-1] / args.temperature)
            loss = loss - args.entropy_coef * self._aggregate(entropy, inputs)

        weights = mask.to(logps.dtype)
        with torch.no_grad():
            clipped_values = old_values + (values - old_values).clamp(-args.cliprange_value, args.cliprange_value)
            value_clipped = (clipped_values - returns) ** 2 > (values - returns) ** 2
            log_ratio = logps - inputs["old_logps"]
            # A micro-batch's loss is its share of the optimizer step's: x accumulation steps, the window's mean
            # is the mean optimizer-step loss.
            steps = args.gradient_accumulation_steps
            self.record_metrics({
                **policy_metrics,
                "loss/policy": policy_loss * steps, "loss/value": value_loss * steps,
                "value/clipfrac": _masked_mean(value_clipped.to(weights.dtype), weights),
                "policy/approxkl": _masked_mean(0.5 * log_ratio ** 2, weights),
                "entropy": _masked_mean(entropy.detach(), weights),
            })
        return (loss, None) if return_outputs else loss

    def _aggregate(self, per_token: torch.Tensor, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
        """A per-token loss reduced like the policy loss: this micro-batch's share of the optimizer step."""
        loss = aggregate_loss(per_token, inputs["loss_mask"], self.args.loss_type,
                              total_sequences=inputs["total_sequences"], total_tokens=inputs["total_tokens"],
                              max_completion_length=self.args.max_completion_length)
        return loss * self.accelerator.num_processes

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
        raise ConfigError(f"reward_processing_classes has {len(classes)} entries but there are {len(funcs)} reward "
                          "functions; give one per reward function, in the same order.")
    for i, func in enumerate(funcs):
        if isinstance(func, (str, PreTrainedModel)):
            classes[i] = load_tokenizer(func, classes[i])
            funcs[i] = load_sequence_classifier(func, num_labels=1, tokenizer=classes[i])
    return funcs, classes


def _completion_values(outputs: CausalLMWithValueOutput, width: int) -> torch.Tensor:
    """The values [B, width] of the positions that predict the completion tokens (as the kept logits are)."""
    return outputs.values[:, -(width + 1):-1]


def _masked_mean(values: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    return (values * weights).sum() / weights.sum().clamp(min=1)


def _explained_variance(values: torch.Tensor, returns: torch.Tensor) -> float:
    """1 - Var(returns - values) / Var(returns): 1 for a perfect critic, 0 for a constant one (NaN if undefined)."""
    if returns.numel() < 2 or returns.var() == 0:
        return float("nan")
    return float(1 - (returns - values).var() / returns.var())
