"""The online RL engine: one rollout loop that GRPO, RLOO and PPO configure through a few hooks.

Every `steps_per_generation` optimizer steps the engine makes a fresh round (rollout.py holds its records) and
then trains on it, in explicit phases:

    prompts ──► generate_episodes: num_generations episodes per prompt, as token ids (Episode)
            ──► score: RewardScorer (decoded text goes to the reward functions only)
            ──► build_rollout: padded tensors with named fields (Rollout)
            ──► policy_tensors: old log-probs (policy before the update), reference log-probs (beta > 0)
            ──► compute_advantages: the method's estimator (rewards of the whole round, all processes)
            ──► update: steps_per_generation optimizer steps, repeated num_iterations times, each made of
                gradient_accumulation_steps micro-batches of per_device_train_batch_size completions:
                policy_loss + aggregation over the whole optimizer step's totals.

A method is its estimator and its loss: `compute_advantages` (required) returns `Advantages`;
`policy_tensors` returns more rollout fields (PPO: the critic's values); `policy_loss` / `compute_loss` (PPO
adds a value loss); `needs_old_logps` and `kl_in_loss` say what the loss reads; `sample_groups` (phases 1-2)
lets GRPO's dynamic sampling regenerate zero-variance groups. Hooks return values; the engine puts them into
the rollout. With async_generation_rounds, phase 1 of the training rounds runs ahead in a background thread
(async_rollouts.py).

Batching. per_device_train_batch_size counts completions. One generation round produces
generation_batch_size = per_device_train_batch_size x gradient_accumulation_steps x steps_per_generation x
processes completions; each process generates for its own prompts, and all num_generations completions of
a prompt are generated on the same process. Rewards are gathered, so group or batch statistics see every
process. Sampling is seeded per prompt (from the seed, the round and the prompt's position in the round),
so the completions do not depend on how a round is split across processes or micro-batches.

Metrics, per logging window (TRL's names): num_tokens (prompt + completion tokens seen), reward, reward_std
(over the whole generation batch), frac_reward_zero_std (groups whose rewards are all equal), rewards/<name>/mean
and /std, completions/mean_length, /min_length, /max_length, /clipped_ratio (fraction cut at
max_completion_length), /mean_terminated_length, /min_.., /max_.. (completions that ended); posttrain's own:
frac_reward_none (no reward applies), advantages/mean and /std, time/generation and time/scoring (seconds per
generation round);
and per micro-batch: kl (when there is a reference), clip_ratio/low_mean, /high_mean, /region_mean,
entropy, time/update (seconds per optimizer step, forward and backward). Evaluation (online_eval.py) logs the
same keys with the eval_ prefix.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from typing import ClassVar

import torch
from torch.utils.data import DataLoader

from posttrain.data.chat import apply_chat_template, require_chat_template
from posttrain.data.formats import is_message_list
from posttrain.data.report import DataReport, cut_column
from posttrain.errors import ConfigError, DataError
from posttrain.generation import create_generation_backend
from posttrain.generation.vllm_backend import sampler_logps_tensor, sampler_mismatch_metrics
from posttrain.losses.policy import (
    aggregate_loss,
    objective_metrics,
    policy_objective,
)
from posttrain.losses.token_weights import sampler_importance_weights, sampler_ratio_metrics
from posttrain.models.reference import create_reference_model, is_peft_model, reference_forward, unwrap
from posttrain.online.async_rollouts import AsyncRolloutProducer
from posttrain.online.config import OnlineConfig
from posttrain.online.episodes import make_episode_source

# Columns the engine adds or reads itself; every other dataset column is passed to the reward functions.
from posttrain.online.evaluation import COMPLETIONS_LOG, OnlineEvaluation, nanstd
from posttrain.online.logps import completion_logps
from posttrain.online.rollout import (
    PROMPT_COLUMN,
    PROMPT_IDS_COLUMN,
    Advantages,
    Episode,
    Rollout,
    RolloutLoader,
    RolloutSampler,
    StreamingRolloutLoader,
    TaggedPrompts,
    collate_tagged,
    groupwise_advantages,
    pad_rows,
    round_seeds,
)
from posttrain.online.vision import setup_online_vision, tokenizer_of
from posttrain.rewards.scoring import RewardScorer
from posttrain.runtime.distributed import root_gathered
from posttrain.tools import EnvironmentPool, tool_schemas
from posttrain.training.base import BaseTrainer, setup_router_aux_loss
from posttrain.training.streaming import is_streaming
from posttrain.training.sync_ref import SyncRefModelCallback, load_sync_ref_checkpoint_state, sync_ref_checkpoint_state

__all__ = [
    "COMPLETIONS_LOG",
    "Advantages",
    "Episode",
    "OnlineConfig",
    "OnlineTrainer",
    "Rollout",
    "RolloutSampler",
    "groupwise_advantages",
    "nanstd",
]


# -- prompts -----------------------------------------------------------------------------------------------
def _tokenize_prompt(
    example: dict,
    row: int,
    tokenizer,
    conversational: bool,
    max_prompt_length: int | None,
    chat_template_kwargs: dict | None = None,
):
    prompt = example[PROMPT_COLUMN]
    if conversational != is_message_list(prompt) or not (conversational or isinstance(prompt, str)):
        expected = "a non-empty list of {'role', 'content'} messages" if conversational else "a string"
        raise DataError(
            f"Row {row}, column 'prompt': expected {expected} like row 0, got {prompt!r:.80}. Fix or drop that row."
        )
    if conversational:
        text = apply_chat_template({PROMPT_COLUMN: prompt}, tokenizer, **(chat_template_kwargs or {}))[PROMPT_COLUMN]
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    else:
        ids = tokenizer(prompt)["input_ids"]
    if not ids:
        raise DataError(
            f"Row {row}: the prompt is empty after tokenization; generation needs at least one prompt "
            "token. Remove the row or give it a prompt."
        )
    cut = 0 if max_prompt_length is None else max(len(ids) - max_prompt_length, 0)
    return {PROMPT_IDS_COLUMN: ids[cut:], cut_column("max_prompt_length"): cut}


def _column_names(dataset) -> list[str]:
    """The dataset's columns (a stream without declared features shows them in its first row)."""
    if dataset.column_names is not None:
        return list(dataset.column_names)
    return list(next(iter(dataset), {}))


def _require_prompt_column(dataset, name: str) -> None:
    columns = _column_names(dataset)
    if PROMPT_COLUMN not in columns:
        raise DataError(
            f"{name} needs a 'prompt' column (strings or lists of messages) but has the columns "
            f"{columns}; rename the column holding the prompts, e.g. "
            "dataset.rename_column('question', 'prompt')."
        )
    if (next(iter(dataset), None) is None) if is_streaming(dataset) else len(dataset) == 0:
        raise DataError(f"{name} is empty; pass at least one prompt.")


def _refuse_stream_lookahead(args) -> None:
    """Settings that read prompts out of order, which a stream cannot give."""
    reasons = {
        "async_generation_rounds": "rounds generated ahead look their prompts up by index",
        "dynamic_sampling": "extra batches are drawn at random from the training set",
    }
    for name, reason in reasons.items():
        if getattr(args, name, None):
            raise ConfigError(
                f"{name}={getattr(args, name)!r} does not work with a streaming train_dataset (IterableDataset): "
                f"{reason}. Turn it off, or load the dataset without streaming."
            )


@dataclasses.dataclass
class ScoredGroups:
    """Phases 1-2's result: the prompts' rows and their episodes, n per row (prompt-major), with their rewards."""

    rows: list[dict]
    episodes: list[Episode]
    prompts: list
    texts: list[str]
    rewards: torch.Tensor  # [len(rows) * n]
    per_function: torch.Tensor  # [len(rows) * n, reward functions]
    timings: dict[str, float]

    def groups(self, indices: list[int]) -> ScoredGroups:
        """The groups (rows) at `indices`, with their episodes."""
        n = len(self.episodes) // max(len(self.rows), 1)
        items = [g * n + k for g in indices for k in range(n)]
        rows = torch.tensor(items, dtype=torch.long)
        return ScoredGroups(
            [self.rows[g] for g in indices],
            [self.episodes[i] for i in items],
            [self.prompts[i] for i in items],
            [self.texts[i] for i in items],
            self.rewards[rows],
            self.per_function[rows],
            dict(self.timings),
        )

    @staticmethod
    def concat(parts: list[ScoredGroups]) -> ScoredGroups:
        timings: dict[str, float] = {}
        for part in parts:
            for key, value in part.timings.items():
                timings[key] = timings.get(key, 0.0) + value
        return ScoredGroups(
            sum((p.rows for p in parts), []),
            sum((p.episodes for p in parts), []),
            sum((p.prompts for p in parts), []),
            sum((p.texts for p in parts), []),
            torch.cat([p.rewards for p in parts]),
            torch.cat([p.per_function for p in parts]),
            timings,
        )


# -- the engine --------------------------------------------------------------------------------------------
class OnlineTrainer(OnlineEvaluation, BaseTrainer):
    """`XTrainer(model, reward_funcs, args=XConfig(...), train_dataset=..., eval_dataset=..., peft_config=...)`.

    `train_dataset` (and `eval_dataset`) need a 'prompt' column (strings, or conversations rendered with the
    chat template and its generation prompt); every other column reaches the reward functions by name.
    `reward_funcs` is one or a list of reward functions, reward models or reward model names (see
    `posttrain.rewards.scoring`). `tools`, `environment_factory` and `rollout_func` make episodes multi-turn
    (episodes.py).
    """

    config_class: ClassVar[type[OnlineConfig]] = OnlineConfig
    # What the asynchronous producer (async_rollouts.py) needs to know of a method, declared on its class. A class
    # that defines its own loss is taken not to correct stale samples with the sampler's log-probs unless it says
    # so; one that defines its own generate_episodes generates in a way the producer cannot take over.
    loss_reads_sampler_logps: ClassVar[bool] = True
    loss_ignores_the_sampler: ClassVar[bool] = False
    own_generation: ClassVar[bool] = False

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        own = vars(cls)
        if ("compute_loss" in own or "policy_loss" in own) and "loss_reads_sampler_logps" not in own:
            cls.loss_reads_sampler_logps = False
        if "generate_episodes" in own:
            cls.own_generation = True

    # The loss returned by compute_loss is already this micro-batch's share of the optimizer step's loss.
    loss_is_scaled_for_ga = True
    # Whether beta's KL term goes into the loss (GRPO) rather than into the rewards (RLOO, PPO).
    kl_in_loss: ClassVar[bool] = True

    def __init__(
        self,
        model,
        reward_funcs,
        args: OnlineConfig | None = None,
        train_dataset=None,
        eval_dataset=None,
        processing_class=None,
        reward_processing_classes: list | None = None,
        callbacks=None,
        optimizers=(None, None),
        quantization_config=None,
        peft_config=None,
        tools=None,
        rollout_func=None,
        environment_factory=None,
    ):
        args = args or self.config_class(output_dir=f"outputs/{type(self).__name__.removesuffix('Trainer').lower()}")
        if train_dataset is None:
            raise DataError(f"{type(self).__name__} needs a train_dataset with a 'prompt' column.")
        _require_prompt_column(train_dataset, "train_dataset")
        reward_funcs = list(reward_funcs) if isinstance(reward_funcs, (list, tuple)) else [reward_funcs]
        if environment_factory is not None and reward_funcs == [None]:
            reward_funcs = []  # the environment gives the reward
        if (not reward_funcs and environment_factory is None) or any(f is None for f in reward_funcs):
            raise ConfigError(
                "No reward functions given: pass reward_funcs, e.g. a function "
                "f(prompts, completions, **columns) -> list[float], a reward model, or a list of them."
            )
        if is_streaming(train_dataset):
            _refuse_stream_lookahead(args)
        columns = _column_names(train_dataset)
        self.reward_columns = [c for c in columns if c not in (PROMPT_COLUMN, PROMPT_IDS_COLUMN)]
        self.environments = None if environment_factory is None else EnvironmentPool(environment_factory, tools or ())
        if self.environments is not None:  # an environment with get_reward() is a reward source
            reward_funcs += [function for _, function in self.environments.reward_functions()]
        if not reward_funcs:
            raise ConfigError(
                "No reward source: pass reward_funcs, or an environment_factory whose environment defines a "
                "get_reward() method (its return value is the episode's reward)."
            )
        self.reward_scorer = RewardScorer(
            reward_funcs,
            args.reward_weights,
            reward_processing_classes,
            args.reward_timeout_s,
            args.reward_failure_policy,
        )
        if rollout_func is None:  # its extra fields reach the reward functions; they are checked on the first round
            self.reward_scorer.check_columns(self.reward_columns + (["environments"] if environment_factory else []))
        self._tool_schemas = tool_schemas(tools) if tools and environment_factory is None else None
        self._check_eval_setup(eval_dataset, args)
        if args.sync_ref_model and (peft_config is not None or is_peft_model(model)):
            raise ConfigError(
                "sync_ref_model=True needs a separate reference model, but with a PEFT policy the "
                "reference is the adapter-disabled base; set sync_ref_model=False."
            )
        processing_class, self.image_prompts, peft_config = setup_online_vision(  # processor, image prompts, LoRA
            self,
            model,
            args,
            train_dataset,
            eval_dataset,
            processing_class,
            tools,
            rollout_func,
            environment_factory,
            peft_config,
        )
        if tokenizer_of(processing_class).eos_token_id is None:
            raise ConfigError(
                "The tokenizer has no EOS token, so a completion could never end before "
                "max_completion_length; set tokenizer.eos_token (for a chat model, its end-of-turn "
                "token)."
            )
        prompts_per_round = args.generation_batch_size // args.num_generations
        if not is_streaming(train_dataset) and len(train_dataset) < prompts_per_round:
            raise DataError(
                f"train_dataset has {len(train_dataset)} prompts but one generation round uses {prompts_per_round} "
                f"(generation_batch_size {args.generation_batch_size} / num_generations {args.num_generations}); "
                "add prompts or lower per_device_train_batch_size, gradient_accumulation_steps or "
                "steps_per_generation."
            )
        super().__init__(
            model,
            args,
            train_dataset=train_dataset,
            eval_dataset=eval_dataset,
            processing_class=processing_class,
            peft_config=peft_config,
            callbacks=callbacks,
            optimizers=optimizers,
            quantization_config=quantization_config,
        )
        self.sampling = args.sampling_params()
        self.generation_backend = create_generation_backend(self.model, tokenizer_of(self.processing_class), args)
        self.reward_scorer.to(self.accelerator.device, self.accelerator)
        self.ref_model = None
        if self.uses_reference:
            reference = create_reference_model(self.model, peft=is_peft_model(self.model))
            if reference is not None:
                self.ref_model = self.accelerator.prepare_model(reference, evaluation_mode=True)
        if args.sync_ref_model:
            self.add_callback(
                SyncRefModelCallback(self.ref_model, args.ref_model_mixup_alpha, args.ref_model_sync_steps)
            )
        self.router_aux_loss_coef = setup_router_aux_loss(self.model, args.router_aux_loss_coef)
        self.episode_source = make_episode_source(self, tools, self.environments, rollout_func)
        self.async_rollouts = (
            None
            if args.async_generation_rounds is None
            else AsyncRolloutProducer(self, args.async_generation_rounds, args.vllm_sync_steps)
        )  # async_rollouts.py
        self.rollout: Rollout | None = None
        self._update_seconds = 0.0
        self._pending_completions: list[dict] = []

    def check_prompt_dataset(self, dataset, name: str) -> None:
        """A prompt column, and every column the reward functions read from the training set."""
        _require_prompt_column(dataset, name)
        missing = [c for c in self.reward_columns if c not in _column_names(dataset)]
        if missing:
            raise DataError(
                f"{name} lacks the columns {missing} that train_dataset passes to the reward functions; add them to it."
            )

    def _check_eval_setup(self, eval_dataset, args: OnlineConfig) -> None:
        datasets = eval_dataset.items() if isinstance(eval_dataset, dict) else [("eval_dataset", eval_dataset)]
        for name, dataset in datasets:
            if dataset is not None:
                self.check_prompt_dataset(dataset, name if name == "eval_dataset" else f"eval_dataset[{name!r}]")
        n = args.num_generations_eval or args.num_generations
        if eval_dataset is not None and args.per_device_eval_batch_size % n:
            raise ConfigError(
                f"per_device_eval_batch_size={args.per_device_eval_batch_size} counts completions and "
                f"must be a multiple of num_generations_eval={n} (all completions of an eval prompt "
                "are generated together); change one of them."
            )

    # -- data ------------------------------------------------------------------------------------------
    def prepare_dataset(self, dataset, tokenizer, args: OnlineConfig, name: str):
        """Tokenizes each prompt once (cached by datasets' fingerprint) into a 'prompt_ids' column (image prompts
        are only validated: they are processed a round at a time)."""
        if self.image_prompts is not None and PROMPT_COLUMN in dataset.column_names and len(dataset):
            self.conversational = is_message_list(dataset[0][PROMPT_COLUMN])
            return self.image_prompts.prepare(dataset, name, type(self).__name__)
        tokenizer = tokenizer_of(tokenizer)
        self.conversational = is_message_list(dataset[0][PROMPT_COLUMN])
        if self.conversational:
            require_chat_template(tokenizer, "conversational prompts")
        report = DataReport.of(self).start(name, len(dataset))  # prompts cut by max_prompt_length
        return report.take_cuts(
            dataset.map(
                _tokenize_prompt,
                with_indices=True,
                num_proc=args.dataset_num_proc,
                fn_kwargs=dict(
                    tokenizer=tokenizer,
                    conversational=self.conversational,
                    max_prompt_length=args.max_prompt_length,
                    chat_template_kwargs={
                        **(args.chat_template_kwargs or {}),
                        **({"tools": self._tool_schemas} if self._tool_schemas else {}),
                    },
                ),
                desc=f"Tokenizing the prompts of {name}",
            )
        )

    def default_collator(self, tokenizer, args):
        return collate_tagged

    # Method hooks (online DPO and its variants override them): whether a reference model is loaded and its
    # log-probs computed; completions per micro-batch; the temperature the trained log-probs are taken at.
    @property
    def reward_funcs(self) -> list:
        """The reward sources, in order (TRL's attribute): functions, reward models, an environment's get_reward."""
        return self.reward_scorer.funcs

    @property
    def reward_weights(self) -> torch.Tensor:
        """The weight of each reward source in the total reward (TRL's attribute)."""
        return self.reward_scorer.weights

    @property
    def uses_reference(self) -> bool:
        return self.args.beta > 0

    @property
    def micro_batch_size(self) -> int:
        return self.args.per_device_train_batch_size

    @property
    def logps_temperature(self) -> float:
        return self.args.temperature

    @property
    def micro_steps_per_round(self) -> int:
        return self.args.steps_per_generation * self.args.gradient_accumulation_steps * self.args.num_iterations

    def get_train_dataloader(self) -> DataLoader:
        args = self.args
        if is_streaming(self.train_dataset):
            stream = self.train_dataset
            if args.shuffle_dataset:
                stream = stream.shuffle(seed=args.data_seed if args.data_seed is not None else args.seed)
            return StreamingRolloutLoader(
                stream,
                args.generation_batch_size // args.num_generations,
                self.accelerator.num_processes,
                self.accelerator.process_index,
                self.micro_steps_per_round,
            )
        self.rollout_sampler = sampler = RolloutSampler(
            num_prompts=len(self.train_dataset),
            prompts_per_round=args.generation_batch_size // args.num_generations,
            num_processes=self.accelerator.num_processes,
            process_index=self.accelerator.process_index,
            micro_steps_per_round=self.micro_steps_per_round,
            seed=args.data_seed if args.data_seed is not None else args.seed,
            shuffle=args.shuffle_dataset,
        )
        return RolloutLoader(TaggedPrompts(self.train_dataset), batch_sampler=sampler, collate_fn=collate_tagged)

    # -- one micro-step ----------------------------------------------------------------------------------
    def training_step(self, model, inputs, num_items_in_batch=None):
        """Generates a new round when the batch belongs to one not yet generated, then trains on this
        micro-step's slice of it."""
        if self.rollout is None or self.rollout.round != inputs["round"]:
            self.rollout = self.make_rollout(inputs["rows"], inputs["slots"], inputs["round"])
        args = self.args
        position = inputs["micro_step"] % (args.steps_per_generation * args.gradient_accumulation_steps)
        size = self.micro_batch_size
        batch = self.rollout.batch(position * size, (position + 1) * size)
        batch["total_sequences"] = size * args.gradient_accumulation_steps * self.accelerator.num_processes
        batch["total_tokens"] = self.rollout.step_tokens[position // args.gradient_accumulation_steps]
        start = time.perf_counter()
        loss = super().training_step(model, batch, num_items_in_batch)
        self._update_seconds += time.perf_counter() - start
        if (inputs["micro_step"] + 1) % args.gradient_accumulation_steps == 0:
            self._metrics["train"]["time/update"].append(self._update_seconds)
            self._update_seconds = 0.0
        return loss

    # -- resuming ----------------------------------------------------------------------------------------
    def checkpoint_state(self) -> dict:
        """This process's rollout when the checkpoint falls inside its round (steps_per_generation or
        num_iterations > 1), so that a resumed run finishes the round on the same completions instead of
        generating new ones with the updated policy; and the TR-GRPO synced reference."""
        state = sync_ref_checkpoint_state(self)
        steps_per_round = self.args.steps_per_generation * self.args.num_iterations
        if self.rollout is not None and self.state.global_step % steps_per_round:
            state["rollout"] = self.rollout.state()
        if self.async_rollouts is not None:  # the rounds generated ahead, so that none is sampled again
            state["async_rollouts"] = self.async_rollouts.state()
        return state

    def load_checkpoint_state(self, state: dict) -> None:
        state = dict(state)
        load_sync_ref_checkpoint_state(self, state)
        if "rollout" in state:
            self.rollout = Rollout(**state.pop("rollout"))
        ahead = state.pop("async_rollouts", None)  # rounds generated ahead (regenerated when async is now off)
        if ahead is not None and self.async_rollouts is not None:
            self.async_rollouts.load_state(ahead)
        super().load_checkpoint_state(state)

    def evaluate(self, *args, **kwargs):
        """Evaluation generates with the policy's own weights: no round generates ahead meanwhile."""
        with self.async_rollouts.paused() if self.async_rollouts is not None else contextlib.nullcontext():
            return super().evaluate(*args, **kwargs)

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        # The entropy keeps its gradient only where a method trains on it (GRPO's entropy bonus); the model's
        # outputs are needed only for a Mixture-of-Experts balancing loss.
        logps, entropy, *outputs = self.completion_logps(
            model,
            inputs,
            with_entropy=True,
            return_outputs=bool(self.router_aux_loss_coef),
            entropy_grad=getattr(self, "trains_entropy", False),
        )
        loss, metrics = self.policy_loss(inputs, logps, entropy)
        loss = self.add_router_aux_loss(loss, outputs[0] if outputs else None, metrics)
        mask = inputs["loss_mask"].to(entropy.dtype)
        metrics["entropy"] = (entropy.detach() * mask).sum() / mask.sum().clamp(min=1)
        self.record_metrics(metrics)
        return (loss, None) if return_outputs else loss

    def add_router_aux_loss(self, loss: torch.Tensor, outputs, metrics: dict) -> torch.Tensor:
        """Adds a Mixture-of-Experts model's load-balancing loss (per micro-batch, so divided by the accumulation
        steps as the policy loss is shared out over them), and records it as `aux_loss`."""
        aux_loss = getattr(outputs, "aux_loss", None)
        if not self.router_aux_loss_coef or aux_loss is None:
            return loss
        metrics["aux_loss"] = aux_loss.detach()
        return loss + self.router_aux_loss_coef * aux_loss / self.args.gradient_accumulation_steps

    def policy_loss(
        self,
        inputs: dict[str, torch.Tensor],
        logps: torch.Tensor,
        entropy: torch.Tensor | None = None,
        keep: torch.Tensor | None = None,
    ):
        """This micro-batch's share of the optimizer step's policy loss, and its metrics.

        The per-token objective is `policy_objective` with `self.objective_options()` (GRPO's loss types), the
        0/1 `keep` selection and, when the sampler returned its log-probs (vLLM), `self.sampler_ratio`. The
        share uses the step's totals over all micro-batches and processes; it is multiplied by the number of
        processes because DDP averages the processes' gradients. `entropy` is for methods that select tokens
        or add a bonus by it (GRPO overrides this method).
        """
        args, mask = self.args, inputs["loss_mask"]
        old_logps = inputs.get("old_logps", logps.detach())
        sampler_logps = inputs.get("sampler_logps")  # the sampler's own log-probs of these tokens (vLLM)
        ratio = None
        if sampler_logps is not None and args.vllm_importance_sampling_correction:
            ratio = self.sampler_ratio(old_logps, sampler_logps, mask)
        per_token, stats = policy_objective(
            logps,
            old_logps,
            inputs["advantages"],
            mask,
            epsilon_low=args.epsilon,
            epsilon_high=args.epsilon_high,
            importance_sampling_level=args.importance_sampling_level,
            keep=keep,
            sampler_ratio=ratio,
            ref_logps=inputs.get("ref_logps"),
            beta=args.beta if self.kl_in_loss else 0.0,
            **self.objective_options(),
        )
        loss = aggregate_loss(
            per_token,
            mask,
            args.loss_type,
            total_sequences=inputs["total_sequences"],
            total_tokens=inputs["total_tokens"],
            max_completion_length=args.max_completion_length,
        )
        metrics = objective_metrics(stats, self.accelerator.gather)
        if sampler_logps is not None:
            metrics.update(sampler_mismatch_metrics(old_logps, sampler_logps, mask))
            if ratio is not None:
                metrics.update(sampler_ratio_metrics(ratio, old_logps, sampler_logps, mask))
        return loss * self.accelerator.num_processes, metrics

    def objective_options(self) -> dict:
        """Extra keyword arguments of `policy_objective` (GRPO: its loss type and the options that shape it)."""
        return {}

    def sampler_ratio(
        self, trainer_logps: torch.Tensor, sampler_logps: torch.Tensor, mask: torch.Tensor
    ) -> torch.Tensor:
        """Per-token importance weights min(pi_trainer / pi_sampler, vllm_importance_sampling_cap) (GRPO: its
        vllm_importance_sampling_mode)."""
        return sampler_importance_weights(
            trainer_logps, sampler_logps, mask, "token_truncate", clip_max=self.args.vllm_importance_sampling_cap
        )

    def completion_logps(
        self,
        model,
        batch: dict[str, torch.Tensor],
        with_entropy: bool = False,
        return_outputs: bool = False,
        entropy_grad: bool = False,
    ):
        """`online_logps.completion_logps` at the sampling temperature."""
        return completion_logps(
            model,
            batch,
            self.logps_temperature,
            with_entropy=with_entropy,
            return_outputs=return_outputs,
            entropy_grad=entropy_grad,
        )

    # -- generation rounds: generate -> score -> policy tensors -> advantages ---------------------------------
    @property
    def needs_old_logps(self) -> bool:
        """The policy changes between generation and training only with several steps or passes per round."""
        return self.args.steps_per_generation > 1 or self.args.num_iterations > 1

    def make_rollout(self, rows: list[dict], slots: list[int], round_index: int) -> Rollout:
        """Generates, scores and prepares this process's share of a round: of training, or of evaluation while
        `rollout_mode` is "eval" (num_generations_eval completions per prompt, nothing in completions.jsonl)."""
        args, mode = self.args, self.rollout_mode
        n = args.num_generations if mode == "train" else args.num_generations_eval or args.num_generations
        scored = self.sample_groups(rows, n, round_seeds(self.args.seed, round_index, slots, mode), round_index)
        rows, episodes, prompts, texts = scored.rows, scored.episodes, scored.prompts, scored.texts
        rewards, per_function = scored.rewards, scored.per_function
        if self.episode_source is not None and hasattr(self.episode_source, "tools"):
            self.record_tool_use(episodes, mode)
        rollout = self.build_rollout(round_index, rows, n, episodes, rewards, per_function)
        rollout = dataclasses.replace(rollout, **self.policy_tensors(rollout))
        estimate = self.compute_advantages(self.accelerator.gather(rollout.rewards), rollout)
        rollout = dataclasses.replace(
            rollout,
            advantages=estimate.advantages,
            returns=estimate.returns,
            loss_mask=rollout.loss_mask if estimate.loss_mask is None else estimate.loss_mask,
        )
        if mode == "train":
            rollout.step_tokens = self._step_token_totals(rollout)
        for key, value in estimate.metrics.items():
            self._metrics[mode][key].append(float(value))
        self.record_round(
            rollout,
            self.accelerator.gather(rollout.rewards),
            self.accelerator.gather(rollout.per_function_rewards),
            mode,
            scored.timings,
        )
        if args.log_completions and mode == "train":
            self.log_completions(
                prompts, texts, rewards.tolist(), per_function.tolist(), [e.messages for e in episodes]
            )
        return rollout

    def sample_groups(self, rows: list[dict], n: int, seeds: list[int], round_index: int) -> ScoredGroups:
        """Phases 1 and 2: `n` episodes per prompt, scored. A hook: GRPO's dynamic sampling replaces the groups
        whose rewards are all equal by generating for more prompts."""
        return self.generate_and_score(rows, n, seeds, round_index)

    def generate_and_score(self, rows: list[dict], n: int, seeds: list[int], round_index: int) -> ScoredGroups:
        """`n` episodes per prompt, scored, every group kept: what `sample_groups` does unless a method overrides
        it, and what an override or a method's own sampling (A2PO's value estimates) builds on."""
        start = time.perf_counter()
        with root_gathered(self.model):  # FSDP2: the sharded root's weights (distributed.py)
            episodes = (
                self.async_rollouts.episodes(round_index, rows, n, seeds)
                if self.async_rollouts is not None and self.rollout_mode == "train"
                else self.generate_episodes(rows, n, seeds)
            )
        generation_seconds = time.perf_counter() - start
        start = time.perf_counter()
        prompts = [row[PROMPT_COLUMN] for row in rows for _ in range(n)]
        texts, completions = self.completion_texts(prompts, episodes)
        per_function, rewards = self.reward_scorer(
            prompts=prompts,
            completions=completions,
            completion_ids=[e.token_ids for e in episodes],
            columns={
                **{c: [row[c] for row in rows for _ in range(n)] for c in self.reward_columns},
                **self.episode_columns(episodes),
            },
            trainer_state=self.state,
        )
        return ScoredGroups(
            rows,
            episodes,
            prompts,
            texts,
            rewards,
            per_function,
            {"time/generation": generation_seconds, "time/scoring": time.perf_counter() - start},
        )

    def generate_episodes(self, rows: list[dict], n: int, seeds: list[int]) -> list[Episode]:
        """Phase 1: `n` episodes per prompt, prompt-major, sampled with the policy's current weights."""
        if self.rollout_mode == "train":
            self.generation_backend.sync_weights(self.model)
        if self.image_prompts is not None:
            return self.image_prompts.generate(self.generation_backend, rows, n, self.sampling, seeds)
        prompt_ids = [row[PROMPT_IDS_COLUMN] for row in rows]
        if self.episode_source is not None:
            return self.episode_source.generate(rows, prompt_ids, n, self.sampling, seeds, PROMPT_COLUMN)
        return [Episode.single_turn(c) for c in self.generation_backend.generate(prompt_ids, n, self.sampling, seeds)]

    def completion_texts(self, prompts: list, episodes: list[Episode]) -> tuple[list[str], list]:
        """The decoded completions, and what the reward functions receive: the text, or for conversational
        prompts the assistant's messages."""
        texts = self.processing_class.batch_decode([e.token_ids for e in episodes], skip_special_tokens=True)
        if not is_message_list(prompts[0]):
            return texts, texts
        return texts, [e.messages or [{"role": "assistant", "content": t}] for e, t in zip(episodes, texts)]

    def episode_columns(self, episodes: list[Episode]) -> dict[str, list]:
        """Per-episode values the reward functions receive beside the dataset's columns (an environment's
        `environments`, a rollout_func's extra fields)."""
        return {key: [e.reward_kwargs[key] for e in episodes] for key in episodes[0].reward_kwargs}

    def record_tool_use(self, episodes: list[Episode], mode: str) -> None:
        """TRL's tool metrics over all processes: calls per episode, failed calls per call; and model turns per
        episode."""
        local = torch.tensor(
            [
                [
                    sum(e.info["tool_calls"] for e in episodes),
                    sum(e.info["tool_failures"] for e in episodes),
                    sum(e.info["turns"] for e in episodes),
                    len(episodes),
                ]
            ],
            dtype=torch.float64,
            device=self.accelerator.device,
        )
        calls, failures, turns, count = self.accelerator.gather(local).sum(0).tolist()
        self._metrics[mode]["tools/call_frequency"].append(calls / count)
        self._metrics[mode]["tools/failure_frequency"].append(failures / calls if calls else 0.0)
        self._metrics[mode]["tools/mean_turns"].append(turns / count)

    def build_rollout(
        self,
        round_index: int,
        rows: list[dict],
        n: int,
        episodes: list[Episode],
        rewards: torch.Tensor,
        per_function: torch.Tensor,
    ) -> Rollout:
        """Phase 2's result as padded tensors on the device."""
        device, multiple = self.accelerator.device, self.pad_multiple
        pad_id = tokenizer_of(self.processing_class).pad_token_id
        prompt_rows = [e.prompt_ids or rows[i // n][PROMPT_IDS_COLUMN] for i, e in enumerate(episodes)]
        prompt_ids, prompt_mask = pad_rows(prompt_rows, pad_id, left=True, multiple=multiple)
        completion_ids, completion_mask = pad_rows(
            [e.token_ids for e in episodes], pad_id, left=False, multiple=multiple
        )
        model_mask = pad_rows([e.model_mask for e in episodes], 0, left=False, multiple=multiple)[0]
        sampler_logps = sampler_logps_tensor(episodes, completion_ids.shape[1])
        finished = torch.tensor([e.finished for e in episodes])
        loss_mask = model_mask * finished.unsqueeze(1) if self.args.mask_truncated_completions else model_mask
        return Rollout(
            round_index,
            prompt_ids.to(device),
            prompt_mask.to(device),
            completion_ids.to(device),
            completion_mask.to(device),
            model_mask.to(device),
            loss_mask.to(device),
            finished.to(device),
            rewards.to(device),
            per_function.to(device),
            num_generations=n,
            sampler_logps=None if sampler_logps is None else sampler_logps.to(device),
            episodes=[e.info for e in episodes],
            pad_to_multiple_of=multiple,
            policy_version=episodes[0].info.get("policy_version", self.state.global_step),
            vision=None if episodes[0].vision is None else [e.vision for e in episodes],
        )

    @property
    def pad_multiple(self) -> int | None:
        """pad_to_multiple_of resolved: 'auto' pads to 128 on Neuron (a compile per shape), else not at all."""
        multiple = self.args.pad_to_multiple_of
        if multiple == "auto":
            return 128 if self.accelerator.device.type == "neuron" else None
        return multiple

    def policy_tensors(self, rollout: Rollout) -> dict[str, torch.Tensor]:
        """Phase 3: the rollout fields computed from the models before the update: old log-probs (when the
        policy will have changed by the time a micro-batch is trained) and reference log-probs (beta > 0)."""
        out = {}
        if self.needs_old_logps:
            out["old_logps"] = self._rollout_logps(rollout, unwrap(self.model))
        if self.uses_reference:
            with reference_forward(self.model, self.ref_model) as reference:
                out["ref_logps"] = self._rollout_logps(rollout, reference)
        return out

    @torch.no_grad()
    def _rollout_logps(self, rollout: Rollout, model) -> torch.Tensor:
        """Log-probs [N, T] of all completions of the rollout, computed in micro-batches."""
        logps = torch.zeros(rollout.completion_ids.shape, device=rollout.completion_ids.device)
        size = self.args.per_device_train_batch_size
        for start in range(0, len(rollout), size):
            chunk, _ = self.completion_logps(model, rollout.batch(start, start + size))
            logps[start : start + size, : chunk.shape[1]] = chunk
        return logps

    def compute_advantages(self, rewards: torch.Tensor, rollout: Rollout) -> Advantages:
        """Phase 4, the method's estimator: advantages for this process's completions, [N] or per token [N, T].

        `rewards` [num_processes * N] are the round's rewards over all processes in prompt order (NaN where
        no reward function applies); `rollout` is this process's share, with its policy tensors.
        """
        raise NotImplementedError

    def local_share(self, values: torch.Tensor) -> torch.Tensor:
        """This process's rows of a tensor gathered over processes (in process order)."""
        size = values.shape[0] // self.accelerator.num_processes
        return values[self.accelerator.process_index * size :][:size]

    def _step_token_totals(self, rollout: Rollout) -> list[float]:
        """Loss tokens of each optimizer step of the round, summed over processes (aggregate_loss's totals)."""
        per_step = self.micro_batch_size * self.args.gradient_accumulation_steps
        local = rollout.loss_mask.sum(1).view(-1, per_step).sum(1).float()
        return self.accelerator.gather(local).view(-1, local.numel()).sum(0).tolist()
