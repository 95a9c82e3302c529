"""`PPOConfig`: the settings of PPO, with the field names, defaults and help of TRL's last PPO trainer."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, fields
from typing import ClassVar

from posttrain.errors import ConfigError
from posttrain.online.engine import OnlineConfig
from posttrain.training.fields import config_field, max_completion_length_field

# PPO's names for engine settings: PPOConfig(num_ppo_epochs=4) is OnlineConfig(num_iterations=4), etc.
# response_length is the name of the last TRL PPOConfig (trl.experimental.ppo).
_PPO_NAMES = {
    "num_ppo_epochs": "num_iterations",
    "cliprange": "epsilon",
    "kl_coef": "beta",
    "response_length": "max_completion_length",
}


@dataclass
class PPOConfig(OnlineConfig):
    """Settings of `PPOTrainer`: the online options plus PPO's epochs, clip ranges, value loss, GAE and KL control,
    with the last TRL PPOConfig's names.

    OnlineConfig with PPO's settings. One rollout is generation_batch_size completions (one per prompt
    by default); it is split into num_mini_batches mini-batches of per_device_train_batch_size x
    gradient_accumulation_steps x processes completions, one optimizer step each, and passed over
    num_ppo_epochs times.

    See docs/trainers/ppo.md.
    """

    method: ClassVar[str] = "PPO"
    unsupported_options: ClassVar[dict[str, str]] = {
        **OnlineConfig.unsupported_options,
        "router_aux_loss_coef": "the policy-and-value forward does not return a Mixture-of-Experts model's "
        "load-balancing loss yet, so it cannot be added to PPO's loss.",
    }

    num_generations: int = config_field(1, "Completions sampled per prompt.")
    num_ppo_epochs: int = config_field(4, "Passes over each rollout (num_iterations in the engine's terms).")
    num_mini_batches: int | None = config_field(
        None,
        "Optimizer steps (mini-batches) per rollout, each of per_device_train_batch_size x "
        "gradient_accumulation_steps x processes completions (steps_per_generation / gradient_accumulation_steps "
        "in the engine's terms; default 1, or derived from generation_batch_size).",
        min=1,
    )
    cliprange: float = config_field(0.2, "Clip range of the policy ratio (epsilon).")
    cliprange_value: float = config_field(
        0.2,
        "A new value may move at most this far from the rollout's value before its loss stops improving.",
        gt=0,
    )
    vf_coef: float = config_field(0.1, "Weight of the value loss.", min=0)
    entropy_coef: float = config_field(0.0, "Weight of the entropy bonus (0: none).", min=0)
    kl_coef: float = config_field(
        0.05,
        "(Initial) KL coefficient: kl_coef x (log pi - log pi_ref) is subtracted from every token's reward "
        "(beta in the engine's terms; 0: no reference model).",
    )
    target_kl: float | None = config_field(
        None,
        "Adaptive KL (Ziegler et al. 2019): after every rollout kl_coef moves towards keeping a completion's "
        "summed KL at target_kl. None: kl_coef stays fixed.",
    )
    kl_horizon: float = config_field(
        10000, "Adaptive KL horizon: kl_coef changes by at most 20% per horizon completions.", gt=0
    )
    gamma: float = config_field(1.0, "Discount factor of GAE, in (0, 1].")
    lam: float = config_field(0.95, "GAE lambda, in (0, 1]: 1 is Monte-Carlo returns, lower trusts the critic more.")
    whiten_advantages: bool = config_field(True, "Scale the advantages of each rollout to mean 0 and std 1.")
    missing_eos_penalty: float | None = config_field(
        None, "Subtract this from the score of a completion cut at max_completion_length (without an EOS token)."
    )
    use_value_head: bool = config_field(
        False,
        "Put a value head on the policy instead of training a separate value model (less memory; the two "
        "losses share the network).",
    )
    # -- the settings of the last TRL PPOConfig (trl.experimental.ppo), with its defaults
    temperature: float = config_field(0.7, "Sampling temperature; the log-probabilities are of logits / temperature.")
    response_length: int = config_field(53, "Same as max_completion_length.")
    max_completion_length: int = max_completion_length_field(53)
    whiten_rewards: bool = config_field(
        False,
        "Scale the per-token rewards (KL penalty + score) of each rollout to unit variance, keeping their "
        "mean, before GAE.",
    )
    kl_estimator: str = config_field(
        "k1",
        "Per-token KL estimate in the reward (Schulman's 'Approximating KL'): 'k1' = log pi - log pi_ref, "
        "'k3' = (r - 1) - log r with r = pi_ref / pi.",
        choices=("k1", "k3"),
    )
    total_episodes: int | None = config_field(
        None,
        "Completions to train on in all; sets max_steps to the rollouts needed x optimizer steps per rollout "
        "(None: num_train_epochs over the prompts).",
        min=1,
    )
    local_rollout_forward_batch_size: int = config_field(
        64,
        "Completions per no-gradient forward pass when the rollout's log-probs and values are computed "
        "(memory only; the results are the same).",
        min=1,
    )
    num_sample_generations: int = config_field(
        10,
        "How many times in training to log near-greedy completions of one eval batch with their scores (needs "
        "eval_dataset; 0: never).",
        min=0,
    )
    stop_token: str | None = config_field(
        None,
        "'eos': completions stop at the tokenizer's EOS token (posttrain always stops there).",
        choices=("eos",),
    )
    stop_token_id: int | None = config_field(None, "A token id that also ends a completion (besides EOS).")
    exp_name: str = config_field("ppo_config", "Experiment name; run_name defaults to '<exp_name>__<seed>__<time>'.")
    reward_model_path: str = config_field(
        "EleutherAI/pythia-160m",
        "For scripts: where to load the reward model from (the trainer takes the model itself, reward_model=...).",
    )
    sft_model_path: str = config_field(
        "EleutherAI/pythia-160m",
        "For scripts: where to load the policy from (the trainer takes the model itself, model=...).",
    )
    model_adapter_name: str | None = config_field(
        None, "With a PEFT policy holding several adapters: the one to train."
    )
    ref_adapter_name: str | None = config_field(
        None,
        "With a PEFT policy holding several adapters: the one that is the reference (default: the base model "
        "with adapters disabled).",
    )
    # The engine's names for three of the settings above, with PPO's defaults; set either name.
    num_iterations: int = config_field(4, "Same as num_ppo_epochs.")
    epsilon: float = config_field(0.2, "Same as cliprange.")
    beta: float = config_field(0.05, "Same as kl_coef.")

    def __post_init__(self):
        self._merge_ppo_names()
        if self.stop_token is not None and self.stop_token_id is not None:
            raise ConfigError("stop_token and stop_token_id are the same setting; set only one.")
        if self.run_name is None:
            self.run_name = f"{self.exp_name}__{self.seed}__{int(time.time())}"
        super().__post_init__()
        if self.total_episodes is not None:
            self._steps_from_episodes()
        for name in ("gamma", "lam"):
            value = getattr(self, name)
            if not 0 < value <= 1:
                raise ConfigError(f"{name}={value} must be in (0, 1] (typical: gamma=1.0, lam=0.95).")
        if self.target_kl is not None and (self.target_kl <= 0 or self.kl_coef == 0):
            raise ConfigError(
                f"target_kl={self.target_kl} adapts kl_coef={self.kl_coef}: it needs target_kl > 0 "
                "and kl_coef > 0 (or target_kl=None for a fixed coefficient)."
            )

    def _steps_from_episodes(self) -> None:
        """max_steps for total_episodes completions: whole rollouts, each num_ppo_epochs x num_mini_batches steps."""
        if self.max_steps > 0:
            raise ConfigError(
                f"total_episodes={self.total_episodes} and max_steps={self.max_steps} both set the "
                "length of training; set only one."
            )
        rollouts = math.ceil(self.total_episodes / self.generation_batch_size)
        self.max_steps = rollouts * self.num_iterations * self.optimizer_steps_per_generation

    def _merge_ppo_names(self) -> None:
        """Either name of a setting may be changed from the default (`cliprange` or `epsilon`, ...); changing both
        to different values fails."""
        defaults = {f.name: f.default for f in fields(self)}
        for ppo_name, engine_name in _PPO_NAMES.items():
            ppo_value, engine_value = getattr(self, ppo_name), getattr(self, engine_name)
            engine_changed = engine_value != defaults[engine_name]
            if engine_changed and ppo_value != defaults[ppo_name] and engine_value != ppo_value:
                raise ConfigError(
                    f"{ppo_name}={ppo_value} and {engine_name}={engine_value} are the same setting "
                    f"(PPO calls {engine_name} {ppo_name}); set only {ppo_name}."
                )
            value = engine_value if engine_changed else ppo_value
            setattr(self, ppo_name, value)
            setattr(self, engine_name, value)

    def _resolve_generation_batch(self) -> None:
        """num_mini_batches is optimizer steps per rollout: steps_per_generation (micro-batches, TRL's unit) is
        num_mini_batches x gradient_accumulation_steps; checked against generation_batch_size in PPO's terms."""
        accumulation = self.gradient_accumulation_steps
        if self.num_mini_batches is not None:
            if self.steps_per_generation not in (None, self.num_mini_batches * accumulation):
                raise ConfigError(
                    f"num_mini_batches={self.num_mini_batches} and steps_per_generation="
                    f"{self.steps_per_generation} are the same setting (steps_per_generation counts micro-batches: "
                    f"num_mini_batches x gradient_accumulation_steps); set only num_mini_batches."
                )
            mini_batch = self.per_device_train_batch_size * accumulation * self.world_size
            if (
                self.generation_batch_size is not None
                and self.generation_batch_size != self.num_mini_batches * mini_batch
            ):
                fits = (
                    f" or num_mini_batches={self.generation_batch_size // mini_batch}"
                    if self.generation_batch_size % mini_batch == 0
                    else ""
                )
                raise ConfigError(
                    f"generation_batch_size={self.generation_batch_size} (the rollout) does not split into "
                    f"num_mini_batches={self.num_mini_batches} mini-batches of per_device_train_batch_size "
                    f"({self.per_device_train_batch_size}) x gradient_accumulation_steps "
                    f"({accumulation}) x processes ({self.world_size}) = {mini_batch} "
                    f"completions. Set generation_batch_size={self.num_mini_batches * mini_batch}{fits}."
                )
            self.steps_per_generation = self.num_mini_batches * accumulation
        super()._resolve_generation_batch()
        self.num_mini_batches = self.optimizer_steps_per_generation
