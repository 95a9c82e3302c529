"""The online RL engine: one rollout loop that GRPO, RLOO and PPO configure through a few hooks.

Every `steps_per_generation` micro-batches (TRL's unit; a multiple of gradient_accumulation_steps) the
engine makes a fresh round (rollout.py holds its records) and then trains on it, in explicit phases:

    prompts ──► generate_episodes: num_generations episodes per prompt, as token ids (Episode)
            ──► score: RewardScorer (decoded text goes to the reward functions only)
            ──► build_rollout: padded tensors with named fields (Rollout)
            ──► policy_tensors: old log-probs (policy before the update), reference log-probs (beta > 0)
            ──► compute_advantages: the method's estimator (rewards of the whole round, all processes)
            ──► update: steps_per_generation / gradient_accumulation_steps optimizer steps, repeated
                num_iterations times, each made of gradient_accumulation_steps micro-batches of
                per_device_train_batch_size completions:
                policy_loss + aggregation over the whole optimizer step's totals.

A method is its estimator and its loss: `compute_advantages` (required) returns `Advantages`;
`policy_tensors` returns more rollout fields (PPO: the critic's values); `policy_loss` / `compute_loss` (PPO
adds a value loss); `needs_old_logps` and `kl_in_loss` say what the loss reads; `sample_groups` (phases 1-2)
lets GRPO's dynamic sampling regenerate zero-variance groups. Hooks return values; the engine puts them into
the rollout. Phase 1 of a training round comes from the rollout producer (producers/): generated on demand, or
with async_generation_rounds ahead of training in a generation process on cores of its own or in a background
thread. The engine calls it through its interface only, and it sees the trainer only through `producer_context`.

Where it lives: this module sets the trainer up and runs its micro-steps and checkpoints; phases.py holds the
round's phases (generate .. advantages), loss.py the loss, prompts.py the prompts' tokenization and evaluation.py
evaluation and the round metrics.

Batching. per_device_train_batch_size counts completions. One generation round produces
generation_batch_size = per_device_train_batch_size x steps_per_generation x processes completions (TRL's
formula); each process generates for its own prompts, and all num_generations completions of
a prompt are generated on the same process. Rewards are gathered, so group or batch statistics see every
process. Sampling is seeded per prompt (from the seed, the round and the prompt's position in the round),
so the completions do not depend on how a round is split across processes or micro-batches.

Metrics (TRL's names, per logging window; the full list with formulas is on docs/trainers/grpo.md): num_tokens,
reward, reward_std, frac_reward_zero_std, rewards/<name>/mean and /std, completions/* lengths, time/generation and
time/scoring per round; per micro-batch kl, clip_ratio/*, entropy, time/update. Evaluation (evaluation.py) logs the
same keys with the eval_ prefix.
"""

from __future__ import annotations

import logging
import math
import time
from typing import ClassVar

import torch
from torch.utils.data import DataLoader

from posttrain.data.chat import require_chat_template
from posttrain.data.formats import is_message_list
from posttrain.data.report import DataReport
from posttrain.errors import ConfigError, DataError
from posttrain.generation import create_generation_backend
from posttrain.losses.reductions import nanstd
from posttrain.models.reference import create_reference_model, is_peft_model
from posttrain.online.config import OnlineConfig
from posttrain.online.environment_data import environment_dataset, environment_reward_settings
from posttrain.online.episodes import make_episode_source
from posttrain.online.evaluation import COMPLETIONS_LOG, OnlineEvaluation
from posttrain.online.loss import OnlineLoss
from posttrain.online.phases import RoundPhases, ScoredGroups
from posttrain.online.producers import ProducerContext, ProducerEvents, autocast_dtype, make_rollout_producer
from posttrain.online.prompts import (
    column_names,
    model_context,
    refuse_stream_lookahead,
    require_prompt_column,
    tokenize_prompt,
)

# Columns the engine adds or reads itself; every other dataset column is passed to the reward functions.
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
    round_seeds,
)
from posttrain.online.vision import setup_online_vision, tokenizer_of
from posttrain.rewards.scoring import RewardScorer
from posttrain.tools import EnvironmentPool, tool_schemas
from posttrain.training.base import BaseTrainer, setup_router_aux_loss
from posttrain.training.streaming import is_streaming
from posttrain.training.sync_ref import SyncRefModelCallback, load_sync_ref_checkpoint_state, sync_ref_checkpoint_state

logger = logging.getLogger("posttrain")

__all__ = [
    "COMPLETIONS_LOG",
    "Advantages",
    "Episode",
    "OnlineConfig",
    "OnlineTrainer",
    "Rollout",
    "RolloutSampler",
    "ScoredGroups",
    "groupwise_advantages",
    "nanstd",
]


def _check_round_fits(args: OnlineConfig, train_dataset, processing_class) -> None:
    """A tokenizer that can end a completion, and enough prompts for one generation round."""
    if tokenizer_of(processing_class).eos_token_id is None:
        raise ConfigError(
            "The tokenizer has no EOS token, so a completion could never end before "
            "max_completion_length; set tokenizer.eos_token (for a chat model, its end-of-turn "
            "token)."
        )
    prompts_per_round = args.generation_batch_size // args.num_generations
    if not is_streaming(train_dataset) and len(train_dataset) < prompts_per_round:
        logger.warning(
            "train_dataset has %d prompts, fewer than the %d of one generation round (generation_batch_size %d / "
            "num_generations %d): each round takes every prompt, repeated to fill it (an epoch is one round).",
            *(len(train_dataset), prompts_per_round, args.generation_batch_size, args.num_generations),
        )


# -- the engine --------------------------------------------------------------------------------------------
class OnlineTrainer(RoundPhases, OnlineLoss, OnlineEvaluation, BaseTrainer):
    """`XTrainer(model, reward_funcs, args=XConfig(...), train_dataset=..., eval_dataset=..., peft_config=...)`.

    `train_dataset` (and `eval_dataset`) need a 'prompt' column (strings, or conversations rendered with the
    chat template and its generation prompt); every other column reaches the reward functions by name.
    `reward_funcs` is one or a list of reward functions, reward models or reward model names (see
    `posttrain.rewards.scoring`). `tools`, `environment_factory` and `rollout_func` make episodes multi-turn
    (episodes.py).
    """

    config_class: ClassVar[type[OnlineConfig]] = OnlineConfig
    prepares_eval_on_use: ClassVar[bool] = True  # trainer.eval_dataset is the set given, as in TRL
    # What a producer generating ahead (producers/) needs to know of a method, declared on its class. A class
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
        train_dataset, self.placeholder_prompts = environment_dataset(
            train_dataset, args, environment_factory, type(self).__name__
        )
        require_prompt_column(train_dataset, "train_dataset")
        self._setup_rewards(
            reward_funcs, args, train_dataset, reward_processing_classes, tools, rollout_func, environment_factory
        )
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
        _check_round_fits(args, train_dataset, processing_class)
        self.prompt_context = model_context(model, args.trust_remote_code)  # checked when prompts are tokenized
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
        self._setup_generation_and_reference(args, tools, rollout_func)

    def _setup_rewards(
        self, reward_funcs, args, train_dataset, reward_processing_classes, tools, rollout_func, environment_factory
    ) -> None:
        """The reward scorer (with an environment's get_reward() as one more source), the dataset columns it
        reads, the environments and the tools' schemas."""
        reward_funcs = list(reward_funcs) if isinstance(reward_funcs, (list, tuple)) else [reward_funcs]
        if environment_factory is not None and reward_funcs == [None]:
            reward_funcs = []  # the environment gives the reward
        if (not reward_funcs and environment_factory is None) or any(f is None for f in reward_funcs):
            raise ConfigError(
                "No reward source provided (no reward functions given): pass reward_funcs, e.g. a function "
                "f(prompts, completions, **columns) -> list[float], a reward model, or a list of them."
            )
        if is_streaming(train_dataset):
            refuse_stream_lookahead(args)
        columns = column_names(train_dataset)
        self.reward_columns = [c for c in columns if c not in (PROMPT_COLUMN, PROMPT_IDS_COLUMN)]
        self.environments = None if environment_factory is None else EnvironmentPool(environment_factory, tools or ())
        owned = len(reward_funcs)
        if self.environments is not None:  # an environment with get_reward() is a reward source
            reward_funcs += [function for _, function in self.environments.reward_functions()]
            if self.placeholder_prompts:  # the engine's empty prompt is no column of the user's rows
                self.environments.control_columns |= {PROMPT_COLUMN}
        if not reward_funcs:
            raise ConfigError(
                "No reward source provided: pass reward_funcs, or an environment_factory whose environment defines a "
                "get_reward() method (its return value is the episode's reward)."
            )
        weights, reward_processing_classes = environment_reward_settings(
            args, reward_processing_classes, owned, len(reward_funcs) - owned
        )
        self.tools = self.environments.tools if self.environments is not None else list(tools or ())
        self.reward_scorer = RewardScorer(
            reward_funcs,
            weights,
            reward_processing_classes,
            args.reward_timeout_s,
            args.reward_failure_policy,
        )
        if rollout_func is None:  # its extra fields reach the reward functions; they are checked on the first round
            self.reward_scorer.check_columns(self.reward_columns + (["environments"] if environment_factory else []))
        self._tool_schemas = tool_schemas(tools) if tools and environment_factory is None else None

    def _setup_generation_and_reference(self, args: OnlineConfig, tools, rollout_func) -> None:
        """After the model is prepared: the sampler, the reference model, the episode source and the producer of
        rounds generated ahead."""
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
        self.aux_loss_enabled = self.router_aux_loss_coef != 0.0  # TRL's attribute: the MoE loss is trained
        self.episode_source = make_episode_source(self, tools, self.environments, rollout_func)
        self.rollout_producer = make_rollout_producer(self.producer_context())
        self.add_callback(ProducerEvents(self.rollout_producer))
        self.rollout: Rollout | None = None
        self._update_seconds = 0.0
        self._pending_completions: list[dict] = []

    def check_prompt_dataset(self, dataset, name: str) -> None:
        """A prompt column, and every column the reward functions read from the training set."""
        require_prompt_column(dataset, name)
        missing = [c for c in self.reward_columns if c not in column_names(dataset)]
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
                tokenize_prompt,
                with_indices=True,
                num_proc=args.dataset_num_proc,
                fn_kwargs=dict(
                    tokenizer=tokenizer,
                    conversational=self.conversational,
                    max_prompt_length=args.max_prompt_length,
                    context=getattr(self, "prompt_context", None),
                    room=args.max_completion_length,
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

    @property
    def reward_funcs(self) -> list:
        """The reward sources, in order (TRL's attribute): functions, reward models, an environment's get_reward."""
        return self.reward_scorer.funcs

    @property
    def reward_func_names(self) -> list[str]:
        """The name of each reward source, as its metrics are logged (TRL's attribute)."""
        return self.reward_scorer.names

    @property
    def reward_processing_classes(self) -> list:
        """Per reward source, the reward model's tokenizer (given or loaded), None for a function (TRL's attribute)."""
        return self.reward_scorer.processing_classes

    @property
    def reward_weights(self) -> torch.Tensor:
        """The weight of each reward source in the total reward (TRL's attribute)."""
        return self.reward_scorer.weights

    # Method hooks (online DPO and its variants override them): whether a reference model is loaded and its
    # log-probs computed; completions per micro-batch; the temperature the trained log-probs are taken at.
    @property
    def uses_reference(self) -> bool:
        return self.args.beta > 0

    @property
    def micro_batch_size(self) -> int:
        return self.args.per_device_train_batch_size

    @property
    def logps_temperature(self) -> float:
        return self.args.logps_temperature

    @property
    def micro_steps_per_round(self) -> int:
        return self.args.steps_per_generation * self.args.num_iterations

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
        position = inputs["micro_step"] % args.steps_per_generation
        size = self.micro_batch_size
        batch = self.rollout.batch(position * size, (position + 1) * size)
        batch["total_sequences"] = size * args.gradient_accumulation_steps * self.accelerator.num_processes
        batch["total_tokens"] = self.rollout.step_tokens[position // args.gradient_accumulation_steps]
        start = time.perf_counter()
        with self.rollout_producer.update_phase(model):
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
        steps_per_round = self.args.optimizer_steps_per_generation * self.args.num_iterations
        if self.rollout is not None and self.state.global_step % steps_per_round:
            state["rollout"] = self.rollout.state()
        ahead = self.rollout_producer.state()
        if ahead is not None:  # the rounds generated ahead, so that none is sampled again
            state["async_rollouts"] = ahead
        return state

    def load_checkpoint_state(self, state: dict) -> None:
        state = dict(state)
        load_sync_ref_checkpoint_state(self, state)
        if "rollout" in state:
            self.rollout = Rollout(**state.pop("rollout"))
        ahead = state.pop("async_rollouts", None)  # rounds generated ahead (the synchronous producer drops them)
        if ahead is not None:
            self.rollout_producer.load_state(ahead)
        super().load_checkpoint_state(state)

    def evaluate(self, *args, **kwargs):
        """Evaluation generates with the policy's own weights: no round generates ahead meanwhile."""
        with self.rollout_producer.paused():
            return super().evaluate(*args, **kwargs)

    # -- the rollout producer's view of the trainer ------------------------------------------------------
    def producer_context(self) -> ProducerContext:
        """What the rollout producer may use of this trainer (producers/base.py), and what of it a producer
        generating ahead cannot take over."""
        method, args = type(self).__name__, self.args
        unsupported = {
            f"{method}'s loss, which does not read the sampler's log-probs (stale samples would train "
            "uncorrected)": not (self.loss_reads_sampler_logps or self.loss_ignores_the_sampler),
            "tools, environment_factory or rollout_func (multi-turn episodes)": self.episode_source is not None,
            "image prompts": self.image_prompts is not None,
            f"{method}'s own generation (generate_episodes)": self.own_generation,
            "dynamic_sampling (it regenerates inside a round with the current policy)": getattr(
                self.args, "dynamic_sampling", False
            ),
            "several processes (the generation thread would run collectives beside training's; rollout_backend="
            "'ray' routes all their rounds)": self.accelerator.num_processes > 1 and args.rollout_backend != "ray",
        }
        return ProducerContext(
            args=self.args,
            policy=self.model,
            tokenizer=tokenizer_of(self.processing_class),
            sampling=self.sampling,
            micro_batch_size=self.micro_batch_size,
            pad_multiple=self.pad_multiple,
            logps_temperature=self.logps_temperature,
            device=self.accelerator.device,
            autocast_dtype=autocast_dtype(self.accelerator),
            generate=self.fresh_episodes,
            completion_logps=lambda model, batch: self.completion_logps(model, batch),
            round_source=self.training_round,
            every_round_source=lambda index: self.training_round(index, every_process=True),
            log_metric=lambda name, value: self._metrics["train"][name].append(value),
            server_backend=self.generation_backend,
            unsupported=tuple(what for what, present in unsupported.items() if present),
        )

    def training_round(self, index: int, every_process: bool = False) -> tuple[list[dict], list[int]] | None:
        """Training round `index`'s prompt rows and seeds (what the loader will give it; with `every_process`, what
        it gives every process, in process order), None past the last."""
        args = self.args
        if index >= math.ceil(self.state.max_steps / (args.optimizer_steps_per_generation * args.num_iterations)):
            return None
        processes = range(self.accelerator.num_processes) if every_process else [None]
        tags = [tag for process in processes for tag in self.rollout_sampler.round_tags(index, process)]
        slots = [slot for slot, _ in tags]
        return [self.train_dataset[position] for _, position in tags], round_seeds(args.seed, index, slots, "train")
