"""The online RL engine: one rollout loop that GRPO, RLOO and PPO configure through a few hooks.

Every `steps_per_generation` optimizer steps the engine generates a fresh batch and then trains on it:

    prompts ──► generation backend: num_generations completions per prompt, as token ids
            ──► RewardScorer (decoded text goes to the reward functions only)
            ──► old log-probs (policy before the update) and reference log-probs (beta > 0)
            ──► compute_advantages (the method's hook; rewards of the whole batch, all processes)
            ──► steps_per_generation optimizer steps, repeated num_iterations times, each made of
                gradient_accumulation_steps micro-batches of per_device_train_batch_size completions:
                clipped policy loss + aggregation over the whole optimizer step's totals.

Hooks for a method: `compute_advantages` (required), `attach_rollout_tensors` (more per-completion tensors,
e.g. PPO's values), `needs_old_logps`, `kl_in_loss`, and `policy_loss` / `compute_loss` (PPO adds a value loss).

Batching. per_device_train_batch_size counts completions. One generation round produces
generation_batch_size = per_device_train_batch_size x gradient_accumulation_steps x steps_per_generation x
processes completions; each process generates for its own prompts, and all num_generations completions of
a prompt are generated on the same process. Rewards are gathered, so group or batch statistics see every
process. Sampling is seeded per prompt (from the seed, the round and the prompt's position in the round),
so the completions do not depend on how a round is split across processes or micro-batches.

Metrics, per logging window: reward, reward_std (over the whole generation batch), frac_reward_zero_std
(groups whose rewards are all equal), frac_reward_none (no reward applies), rewards/<name>/mean
and /std, advantages/mean and /std, completions/mean_length, /min_length, /max_length, /clipped_ratio
(fraction cut at max_completion_length), time/generation and time/scoring (seconds per generation round);
and per micro-batch: kl (when there is a reference), clip_ratio/low_mean, /high_mean, /region_mean,
entropy, time/update (seconds per optimizer step, forward and backward).
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import torch
from accelerate.utils import gather_object
from torch.utils.data import DataLoader

from ..data.chat import apply_chat_template, require_chat_template
from ..data.formats import is_message_list
from ..errors import ConfigError, DataError
from ..generation import SamplingParams, create_generation_backend, derive_seed
from ..generation.vllm_backend import VLLM_MODES, sampler_logps_tensor, sampler_mismatch_metrics
from ..losses.logprobs import selective_log_softmax
from ..losses.policy import (
    IMPORTANCE_SAMPLING_LEVELS,
    LOSS_TYPES,
    aggregate_loss,
    clipped_policy_loss,
    entropy_from_logits,
    truncated_importance_weights,
)
from ..models.loading import load_tokenizer
from ..models.reference import create_reference_model, is_peft_model, reference_forward, unwrap
from ..rewards.scoring import RewardScorer
from .base import BaseTrainer, PosttrainConfig

# Columns the engine adds or reads itself; every other dataset column is passed to the reward functions.
PROMPT_COLUMN, PROMPT_IDS_COLUMN = "prompt", "prompt_ids"
COMPLETIONS_LOG = "completions.jsonl"


@dataclass
class OnlineConfig(PosttrainConfig):
    """Settings shared by the online trainers. See the module docstring for how the batch sizes relate."""

    min_num_generations: ClassVar[int] = 1
    method: ClassVar[str] = "the online trainer"  # how error messages name the method

    learning_rate: float = field(default=1e-6, metadata={"help": "Peak learning rate."})
    # Generation
    max_prompt_length: int | None = field(
        default=512, metadata={"help": "Keep only the last this-many prompt tokens (None: no limit)."})
    max_completion_length: int = field(default=256, metadata={"help": "Most tokens generated per completion."})
    num_generations: int = field(default=8, metadata={"help": "Completions sampled per prompt (a group)."})
    temperature: float = field(default=1.0, metadata={"help": "Sampling temperature (> 0)."})
    top_p: float = field(default=1.0, metadata={"help": "Nucleus sampling: keep the most likely tokens whose "
                                                        "probabilities add up to top_p (1.0: off)."})
    top_k: int = field(default=0, metadata={"help": "Keep only the top_k most likely tokens (0: off)."})
    min_p: float = field(default=0.0, metadata={"help": "Drop tokens less likely than min_p times the most "
                                                        "likely one (0: off)."})
    repetition_penalty: float = field(
        default=1.0, metadata={"help": "Penalty on tokens already in the prompt or completion (1.0: off)."})
    steps_per_generation: int | None = field(
        default=None, metadata={"help": "Optimizer steps trained on each generated batch before the next one is "
                                        "generated (default 1, or derived from generation_batch_size)."})
    generation_batch_size: int | None = field(
        default=None, metadata={"help": "Completions generated per round over all processes: "
                                        "per_device_train_batch_size x gradient_accumulation_steps x "
                                        "steps_per_generation x processes. Set this or steps_per_generation."})
    num_iterations: int = field(
        default=1, metadata={"help": "Passes over each generated batch (mu in the GRPO paper); > 1 reuses "
                                     "completions with importance ratios to the generating policy."})
    # Rewards
    reward_weights: list[float] | None = field(
        default=None, metadata={"help": "One weight per reward function (default: all 1.0)."})
    reward_timeout_s: float = field(
        default=60.0, metadata={"help": "Seconds an async reward function may take per batch."})
    # Loss
    loss_type: str = field(
        default="dapo", metadata={"help": f"Loss aggregation, one of {LOSS_TYPES}: grpo (mean per completion, then "
                                          "over completions), bnpo/dapo (mean over all tokens of the optimizer "
                                          "step), dr_grpo (token sum / (completions x max_completion_length))."})
    beta: float = field(default=0.0, metadata={"help": "KL coefficient to the reference model (0: no reference "
                                                       "model is loaded)."})
    epsilon: float = field(default=0.2, metadata={"help": "Lower clip range of the importance ratio."})
    epsilon_high: float | None = field(
        default=None, metadata={"help": "Upper clip range (default: epsilon; DAPO's clip-higher uses 0.28)."})
    importance_sampling_level: str = field(
        default="token", metadata={"help": "'token' ratios, or 'sequence' (GSPO: one length-normalised ratio per "
                                           "completion)."})
    mask_truncated_completions: bool = field(
        default=False, metadata={"help": "Leave completions cut at max_completion_length out of the loss (DAPO)."})
    log_completions: bool = field(
        default=False, metadata={"help": "Append {step, prompt, completion, reward} lines to "
                                         "output_dir/completions.jsonl at every generation round."})
    # vLLM generation (docs/vllm.md)
    use_vllm: bool = field(default=False, metadata={"help": "Generate with vLLM instead of transformers' generate."})
    vllm_mode: str = field(
        default="server", metadata={"help": "'server': a vLLM server started with `posttrain vllm-serve`; "
                                            "'colocate': vLLM inside the training process."})
    vllm_server_url: str | None = field(
        default=None, metadata={"help": "Server mode: the server's URL (default http://vllm_server_host:"
                                        "vllm_server_port)."})
    vllm_server_host: str = field(default="127.0.0.1", metadata={"help": "Server mode: the server's host."})
    vllm_server_port: int = field(default=8000, metadata={"help": "Server mode: the server's port."})
    vllm_server_timeout_s: float = field(
        default=240.0, metadata={"help": "Server mode: seconds to wait for the server to come up, and for any one "
                                         "request (a generation round included)."})
    vllm_sync_dir: str | None = field(
        default=None, metadata={"help": "Server mode: directory for the weights synced to the server, readable by "
                                        "it under the same path (default: a temporary directory, right when both "
                                        "run on one machine)."})
    vllm_sync_steps: int = field(
        default=1, metadata={"help": "Push the policy's weights to vLLM every this many optimizer steps."})
    vllm_importance_sampling_correction: bool = field(
        default=True, metadata={"help": "Weight each token's loss by min(exp(trainer - vLLM log-prob), cap): "
                                        "corrects for vLLM sampling from slightly different probabilities."})
    vllm_importance_sampling_cap: float = field(
        default=2.0, metadata={"help": "Cap of the truncated importance weight (> 0)."})
    vllm_gpu_memory_utilization: float = field(
        default=0.3, metadata={"help": "Colocate mode on a GPU, with vllm_kv_cache_gb=None: fraction of GPU memory "
                                       "vLLM may take."})
    vllm_kv_cache_gb: float | None = field(
        default=1.0, metadata={"help": "Colocate mode: vLLM's KV cache in GiB (None: sized from "
                                       "vllm_gpu_memory_utilization on a GPU)."})
    vllm_enable_sleep_mode: bool = field(
        default=False, metadata={"help": "Colocate mode on a GPU: move vLLM's weights and KV cache off the GPU "
                                         "between generation rounds."})

    def __post_init__(self):
        super().__post_init__()
        self.sampling_params()  # validates the sampling settings
        self._check_choice("loss_type", self.loss_type, LOSS_TYPES)
        self._check_choice("importance_sampling_level", self.importance_sampling_level, IMPORTANCE_SAMPLING_LEVELS)
        self._check_choice("vllm_mode", self.vllm_mode, VLLM_MODES)
        if self.vllm_importance_sampling_cap <= 0:
            raise ConfigError(f"vllm_importance_sampling_cap={self.vllm_importance_sampling_cap} must be > 0 "
                              "(typical: 2.0).")
        if self.vllm_sync_steps < 1:
            raise ConfigError(f"vllm_sync_steps={self.vllm_sync_steps} must be at least 1 (1: before every round).")
        if self.num_iterations < 1:
            raise ConfigError(f"num_iterations={self.num_iterations} must be at least 1.")
        if self.beta < 0:
            raise ConfigError(f"beta={self.beta} must be >= 0 (0 switches the KL term off).")
        if self.max_prompt_length is not None and self.max_prompt_length < 1:
            raise ConfigError(f"max_prompt_length={self.max_prompt_length} must be at least 1 (or None: no limit).")
        if self.num_generations < self.min_num_generations:
            reason = ("; its advantages compare each completion with the others of the same prompt"
                      if self.min_num_generations > 1 else "")
            raise ConfigError(
                f"num_generations={self.num_generations}, but {self.method} needs at least "
                f"{self.min_num_generations} completions per prompt{reason}. Set num_generations >= "
                f"{self.min_num_generations} (typical: 4 to 16).")
        self._resolve_generation_batch()

    @staticmethod
    def _check_choice(name: str, value: str, choices: tuple[str, ...]) -> None:
        if value not in choices:
            raise ConfigError(f"{name}={value!r} is not one of {choices}; pick one of them.")

    def _resolve_generation_batch(self) -> None:
        """Sets generation_batch_size and steps_per_generation from whichever the user gave (checked)."""
        per_step = self.per_device_train_batch_size * self.gradient_accumulation_steps  # per process
        processes = self.world_size
        step_batch = per_step * processes
        spelled = (f"per_device_train_batch_size ({self.per_device_train_batch_size}) x gradient_accumulation_steps "
                   f"({self.gradient_accumulation_steps}) x processes ({processes}) = {step_batch}")
        if self.steps_per_generation is not None and self.steps_per_generation < 1:
            raise ConfigError(f"steps_per_generation={self.steps_per_generation} must be at least 1.")
        if self.generation_batch_size is not None:
            if self.generation_batch_size < 1 or self.generation_batch_size % step_batch:
                valid = ", ".join(str(step_batch * k) for k in range(1, 5))
                raise ConfigError(
                    f"generation_batch_size={self.generation_batch_size} must be a multiple of the completions of "
                    f"one optimizer step, {spelled}. Valid values: {valid}, ... (steps_per_generation is "
                    f"generation_batch_size / {step_batch}).")
            derived = self.generation_batch_size // step_batch
            if self.steps_per_generation not in (None, derived):
                raise ConfigError(
                    f"generation_batch_size={self.generation_batch_size} means steps_per_generation={derived} "
                    f"({self.generation_batch_size} / {step_batch}), but steps_per_generation="
                    f"{self.steps_per_generation} was set too. Set only one of them.")
            self.steps_per_generation = derived
        self.steps_per_generation = self.steps_per_generation or 1
        self.generation_batch_size = step_batch * self.steps_per_generation
        local = per_step * self.steps_per_generation
        n = self.num_generations
        if local % n:
            divisors = [d for d in range(self.min_num_generations, local + 1) if local % d == 0]
            steps = self.steps_per_generation * n // math.gcd(n, local)
            raise ConfigError(
                f"num_generations={n} must divide the {local} completions each process generates per round "
                f"(per_device_train_batch_size {self.per_device_train_batch_size} x gradient_accumulation_steps "
                f"{self.gradient_accumulation_steps} x steps_per_generation {self.steps_per_generation}), because "
                f"all completions of a prompt are generated on one process. Valid num_generations here: {divisors}; "
                f"or keep num_generations={n} and make that product a multiple of {n} (e.g. "
                f"steps_per_generation={steps}).")

    def sampling_params(self) -> SamplingParams:
        return SamplingParams(
            max_tokens=self.max_completion_length, temperature=self.temperature, top_p=self.top_p, top_k=self.top_k,
            min_p=self.min_p, repetition_penalty=self.repetition_penalty)


# -- prompts -----------------------------------------------------------------------------------------------
def _tokenize_prompt(example: dict, row: int, tokenizer, conversational: bool, max_prompt_length: int | None):
    prompt = example[PROMPT_COLUMN]
    if conversational != is_message_list(prompt) or not (conversational or isinstance(prompt, str)):
        expected = "a non-empty list of {'role', 'content'} messages" if conversational else "a string"
        raise DataError(f"Row {row}, column 'prompt': expected {expected} like row 0, got {prompt!r:.80}. "
                        "Fix or drop that row.")
    if conversational:
        text = apply_chat_template({PROMPT_COLUMN: prompt}, tokenizer)[PROMPT_COLUMN]
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    else:
        ids = tokenizer(prompt)["input_ids"]
    if not ids:
        raise DataError(f"Row {row}: the prompt is empty after tokenization; generation needs at least one prompt "
                        "token. Remove the row or give it a prompt.")
    if max_prompt_length is not None:
        ids = ids[-max_prompt_length:]
    return {PROMPT_IDS_COLUMN: ids}


def _require_prompt_column(dataset, name: str) -> None:
    if PROMPT_COLUMN not in dataset.column_names:
        raise DataError(f"{name} needs a 'prompt' column (strings or lists of messages) but has the columns "
                        f"{dataset.column_names}; rename the column holding the prompts, e.g. "
                        "dataset.rename_column('question', 'prompt').")
    if len(dataset) == 0:
        raise DataError(f"{name} is empty; pass at least one prompt.")


# -- the order in which prompts are used -------------------------------------------------------------------
class RolloutSampler:
    """For every micro-step, this process's share of the current round's prompts, tagged with the round, the
    micro-step and each prompt's position ("slot") in the round.

    Each epoch shuffles the prompts with (seed, epoch); round r of the epoch takes the next
    prompts_per_round of them, and process p takes the p-th contiguous block. A batch is repeated for every
    micro-step of its round, which lets the trainer find its place in the round (also after resuming).
    """

    def __init__(self, num_prompts: int, prompts_per_round: int, num_processes: int, process_index: int,
                 micro_steps_per_round: int, seed: int) -> None:
        self.num_prompts, self.prompts_per_round = num_prompts, prompts_per_round
        self.num_processes, self.process_index = num_processes, process_index
        self.micro_steps_per_round, self.seed = micro_steps_per_round, seed
        self.rounds_per_epoch = num_prompts // prompts_per_round
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return self.rounds_per_epoch * self.micro_steps_per_round

    def __iter__(self):
        order = torch.randperm(self.num_prompts, generator=torch.Generator().manual_seed(self.seed + self.epoch))
        local = self.prompts_per_round // self.num_processes
        slots = range(self.process_index * local, (self.process_index + 1) * local)
        for r in range(self.rounds_per_epoch):
            round_index = self.epoch * self.rounds_per_epoch + r
            indices = order[r * self.prompts_per_round + slots.start:][:local].tolist()
            for micro_step in range(self.micro_steps_per_round):
                yield [(round_index, micro_step, slot, index) for slot, index in zip(slots, indices)]


class _TaggedPrompts(torch.utils.data.Dataset):
    """Looks up the rows named by RolloutSampler's tags, keeping the tags."""

    def __init__(self, dataset) -> None:
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, tag: tuple[int, int, int, int]):
        return tag, self.dataset[tag[3]]


def _collate_tagged(items: list) -> dict[str, Any]:
    tags, rows = zip(*items)
    return {"round": tags[0][0], "micro_step": tags[0][1], "slots": [t[2] for t in tags], "rows": list(rows)}


class _RolloutLoader(DataLoader):
    """A DataLoader whose epoch reaches the RolloutSampler (the Trainer calls set_epoch on the loader)."""

    def set_epoch(self, epoch: int) -> None:
        self.batch_sampler.set_epoch(epoch)


# -- the generated batch -----------------------------------------------------------------------------------
@dataclass
class Rollout:
    """One round's completions on this process, N = per-process generation batch, prompt-major.

    Prompts are left-padded [N, P], completions right-padded [N, T]. `completion_mask` marks generated
    tokens; `loss_mask` the ones trained on (without truncated completions when those are masked).
    `tensors` holds the per-completion tensors the loss reads: shape [N] or [N, T] (completion-aligned):
    advantages, old_logps, ref_logps, and whatever a method adds.
    """

    round: int
    prompt_ids: torch.Tensor
    prompt_mask: torch.Tensor
    completion_ids: torch.Tensor
    completion_mask: torch.Tensor
    loss_mask: torch.Tensor
    finished: torch.Tensor  # [N] bool: ended with a stop token (else cut at max_completion_length)
    rewards: torch.Tensor  # [N], NaN where no reward function applies
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    step_tokens: list[float] = field(default_factory=list)  # loss tokens per optimizer step, all processes

    def __len__(self) -> int:
        return self.completion_ids.shape[0]

    def batch(self, start: int, stop: int) -> dict[str, torch.Tensor]:
        """Rows [start, stop) with the padding columns no row of the slice needs removed."""
        rows = slice(start, stop)
        prompt_width = int(self.prompt_mask[rows].sum(1).max())
        width = int(self.completion_mask[rows].sum(1).max())
        out = {"prompt_ids": self.prompt_ids[rows, -prompt_width:],
               "prompt_mask": self.prompt_mask[rows, -prompt_width:]}
        per_completion = {"completion_ids": self.completion_ids, "completion_mask": self.completion_mask,
                          "loss_mask": self.loss_mask, **self.tensors}
        for name, value in per_completion.items():
            out[name] = value[rows, :width] if value.dim() == 2 else value[rows]
        return out


def _pad(rows: list[list[int]], value: int, left: bool) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(r) for r in rows)
    padded = [[value] * (width - len(r)) + r if left else r + [value] * (width - len(r)) for r in rows]
    masks = [[0] * (width - len(r)) + [1] * len(r) if left else [1] * len(r) + [0] * (width - len(r)) for r in rows]
    return torch.tensor(padded), torch.tensor(masks)


def nanstd(values: torch.Tensor) -> torch.Tensor:
    """Unbiased standard deviation of the non-NaN entries (0 with fewer than two)."""
    finite = values[~values.isnan()]
    return finite.std() if finite.numel() > 1 else torch.zeros((), dtype=values.dtype, device=values.device)


def groupwise_advantages(
    rewards: torch.Tensor, num_generations: int, advantage_fn: Callable[[torch.Tensor], torch.Tensor]
) -> torch.Tensor:
    """`advantage_fn(group)` for each prompt's group of rewards, over the completions some reward applies to.

    A completion whose reward is NaN (no reward function applies) gets advantage 0 and is left out of its
    group's statistics; so does every completion of a group with fewer than two scored completions.
    `advantage_fn` receives the k scored rewards of one group (1-D) and returns their k advantages.
    """
    advantages = torch.zeros_like(rewards)
    for start in range(0, rewards.numel(), num_generations):
        group = rewards[start:start + num_generations]
        scored = ~group.isnan()
        if int(scored.sum()) >= 2:
            advantages[start:start + num_generations][scored] = advantage_fn(group[scored])
    return advantages


# -- the engine --------------------------------------------------------------------------------------------
class OnlineTrainer(BaseTrainer):
    """`XTrainer(model, reward_funcs, args=XConfig(...), train_dataset=..., processing_class=..., peft_config=...)`.

    `train_dataset` needs a 'prompt' column (strings, or conversations rendered with the chat template and
    its generation prompt); every other column reaches the reward functions by name. `reward_funcs` is one
    or a list of reward functions, reward models or reward model names (see `posttrain.rewards.scoring`).
    """

    config_class: ClassVar[type[OnlineConfig]] = OnlineConfig
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
        peft_config=None,
        callbacks=None,
        optimizers=(None, None),
    ):
        args = args or self.config_class(output_dir=f"outputs/{type(self).__name__.removesuffix('Trainer').lower()}")
        if eval_dataset is not None:
            raise ConfigError(f"{type(self).__name__} does not evaluate on an eval_dataset yet; drop eval_dataset "
                              "(and eval_strategy) and score held-out prompts after training.")
        if train_dataset is None:
            raise DataError(f"{type(self).__name__} needs a train_dataset with a 'prompt' column.")
        _require_prompt_column(train_dataset, "train_dataset")
        reward_funcs = list(reward_funcs) if isinstance(reward_funcs, (list, tuple)) else [reward_funcs]
        if not reward_funcs or any(f is None for f in reward_funcs):
            raise ConfigError("No reward functions given: pass reward_funcs, e.g. a function "
                              "f(prompts, completions, **columns) -> list[float], a reward model, or a list of them.")
        self.reward_columns = [c for c in train_dataset.column_names if c not in (PROMPT_COLUMN, PROMPT_IDS_COLUMN)]
        self.reward_scorer = RewardScorer(reward_funcs, args.reward_weights, reward_processing_classes,
                                          args.reward_timeout_s)
        self.reward_scorer.check_columns(self.reward_columns)
        processing_class = processing_class or load_tokenizer(model)
        if processing_class.eos_token_id is None:
            raise ConfigError("The tokenizer has no EOS token, so a completion could never end before "
                              "max_completion_length; set tokenizer.eos_token (for a chat model, its end-of-turn "
                              "token).")
        prompts_per_round = args.generation_batch_size // args.num_generations
        if len(train_dataset) < prompts_per_round:
            raise DataError(
                f"train_dataset has {len(train_dataset)} prompts but one generation round uses {prompts_per_round} "
                f"(generation_batch_size {args.generation_batch_size} / num_generations {args.num_generations}); "
                "add prompts or lower per_device_train_batch_size, gradient_accumulation_steps or "
                "steps_per_generation.")
        super().__init__(model, args, train_dataset=train_dataset, processing_class=processing_class,
                         peft_config=peft_config, callbacks=callbacks, optimizers=optimizers)
        self.sampling = args.sampling_params()
        self.generation_backend = create_generation_backend(self.model, self.processing_class, args)
        self.reward_scorer.to(self.accelerator.device)
        self.ref_model = None
        if args.beta > 0:
            reference = create_reference_model(self.model, peft=is_peft_model(self.model))
            if reference is not None:
                self.ref_model = self.accelerator.prepare_model(reference, evaluation_mode=True)
        self.rollout: Rollout | None = None
        self._update_seconds = 0.0

    # -- data ------------------------------------------------------------------------------------------
    def prepare_dataset(self, dataset, tokenizer, args: OnlineConfig, name: str):
        """Tokenizes each prompt once (cached by datasets' fingerprint) into a 'prompt_ids' column."""
        self.conversational = is_message_list(dataset[0][PROMPT_COLUMN])
        if self.conversational:
            require_chat_template(tokenizer, "conversational prompts")
        return dataset.map(
            _tokenize_prompt, with_indices=True, num_proc=args.dataset_num_proc,
            fn_kwargs=dict(tokenizer=tokenizer, conversational=self.conversational,
                           max_prompt_length=args.max_prompt_length),
            desc=f"Tokenizing the prompts of {name}",
        )

    def default_collator(self, tokenizer, args):
        return _collate_tagged

    @property
    def micro_steps_per_round(self) -> int:
        return self.args.steps_per_generation * self.args.gradient_accumulation_steps * self.args.num_iterations

    def get_train_dataloader(self) -> DataLoader:
        args = self.args
        sampler = RolloutSampler(
            num_prompts=len(self.train_dataset), prompts_per_round=args.generation_batch_size // args.num_generations,
            num_processes=self.accelerator.num_processes, process_index=self.accelerator.process_index,
            micro_steps_per_round=self.micro_steps_per_round,
            seed=args.data_seed if args.data_seed is not None else args.seed,
        )
        return _RolloutLoader(_TaggedPrompts(self.train_dataset), batch_sampler=sampler, collate_fn=_collate_tagged)

    # -- one micro-step ----------------------------------------------------------------------------------
    def training_step(self, model, inputs, num_items_in_batch=None):
        """Generates a new round when the batch belongs to one not yet generated, then trains on this
        micro-step's slice of it."""
        if self.rollout is None or self.rollout.round != inputs["round"]:
            self.rollout = self.make_rollout(inputs["rows"], inputs["slots"], inputs["round"])
        args = self.args
        position = inputs["micro_step"] % (args.steps_per_generation * args.gradient_accumulation_steps)
        size = args.per_device_train_batch_size
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

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        logps, entropy = self.completion_logps(model, inputs, with_entropy=True)
        loss, metrics = self.policy_loss(inputs, logps)
        mask = inputs["loss_mask"].to(entropy.dtype)
        metrics["entropy"] = (entropy * mask).sum() / mask.sum().clamp(min=1)
        self.record_metrics(metrics)
        return (loss, None) if return_outputs else loss

    def policy_loss(self, inputs: dict[str, torch.Tensor], logps: torch.Tensor):
        """This micro-batch's share of the optimizer step's clipped policy loss, and its metrics.

        The share uses the step's totals over all micro-batches and processes; it is multiplied by the
        number of processes because DDP averages the processes' gradients.
        """
        args = self.args
        old_logps = inputs.get("old_logps", logps.detach())
        per_token, stats = clipped_policy_loss(
            logps, old_logps, inputs["advantages"], inputs["loss_mask"], epsilon_low=args.epsilon,
            epsilon_high=args.epsilon_high, importance_sampling_level=args.importance_sampling_level,
            ref_logps=inputs.get("ref_logps"), beta=args.beta if self.kl_in_loss else 0.0,
        )
        sampler_logps = inputs.get("sampler_logps")  # the sampler's own log-probs of these tokens (vLLM)
        if sampler_logps is not None and args.vllm_importance_sampling_correction:
            per_token = per_token * truncated_importance_weights(old_logps, sampler_logps,
                                                                 args.vllm_importance_sampling_cap)
        loss = aggregate_loss(per_token, inputs["loss_mask"], args.loss_type,
                              total_sequences=inputs["total_sequences"], total_tokens=inputs["total_tokens"],
                              max_completion_length=args.max_completion_length)
        metrics = {"clip_ratio/low_mean": stats["clip_ratio_low"], "clip_ratio/high_mean": stats["clip_ratio_high"],
                   "clip_ratio/region_mean": stats["clip_ratio"]}
        if "kl" in stats:
            metrics["kl"] = stats["kl"]
        if sampler_logps is not None:
            metrics.update(sampler_mismatch_metrics(old_logps, sampler_logps, inputs["loss_mask"]))
        return loss * self.accelerator.num_processes, metrics

    def completion_logps(self, model, batch: dict[str, torch.Tensor], with_entropy: bool = False,
                         return_outputs: bool = False):
        """Per-token log-probs [B, T] of the completion tokens under `model` (logits divided by the sampling
        temperature, as they were sampled), and their entropies when `with_entropy` (no gradient). With
        `return_outputs` the model's outputs come third (PPO reads its values from the same forward)."""
        input_ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], dim=1)
        attention_mask = torch.cat([batch["prompt_mask"], batch["completion_mask"]], dim=1)
        position_ids = (attention_mask.cumsum(1) - 1).clamp(min=0)  # as generate() numbers left-padded rows
        width = batch["completion_ids"].shape[1]
        outputs = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                        logits_to_keep=width + 1, use_cache=False)
        logits = outputs.logits[:, :-1] / self.args.temperature
        logps = selective_log_softmax(logits, batch["completion_ids"])
        entropy = None
        if with_entropy:
            with torch.no_grad():
                entropy = entropy_from_logits(logits)
        return (logps, entropy, outputs) if return_outputs else (logps, entropy)

    # -- generation rounds -------------------------------------------------------------------------------
    @property
    def needs_old_logps(self) -> bool:
        """The policy changes between generation and training only with several steps or passes per round."""
        return self.args.steps_per_generation > 1 or self.args.num_iterations > 1

    def make_rollout(self, rows: list[dict], slots: list[int], round_index: int) -> Rollout:
        """Generates, scores and prepares this process's share of a round."""
        args, n = self.args, self.args.num_generations
        self.generation_backend.sync_weights(self.model)
        start = time.perf_counter()
        completions = self.generation_backend.generate(
            [row[PROMPT_IDS_COLUMN] for row in rows], n, self.sampling,
            seed=[derive_seed(args.seed, round_index, slot) for slot in slots])
        generation_seconds = time.perf_counter() - start

        start = time.perf_counter()
        completion_ids = [c.token_ids for c in completions]
        texts = self.processing_class.batch_decode(completion_ids, skip_special_tokens=True)
        prompts = [row[PROMPT_COLUMN] for row in rows for _ in range(n)]
        per_function, rewards = self.reward_scorer(
            prompts=prompts,
            completions=[[{"role": "assistant", "content": t}] for t in texts] if self.conversational else texts,
            completion_ids=completion_ids,
            columns={c: [row[c] for row in rows for _ in range(n)] for c in self.reward_columns},
            trainer_state=self.state,
        )
        scoring_seconds = time.perf_counter() - start

        device = self.accelerator.device
        prompt_ids, prompt_mask = _pad([row[PROMPT_IDS_COLUMN] for row in rows for _ in range(n)],
                                       self.processing_class.pad_token_id, left=True)
        completion_tensor, completion_mask = _pad(completion_ids, self.processing_class.pad_token_id, left=False)
        finished = torch.tensor([c.finished_with_eos for c in completions])
        loss_mask = completion_mask * finished.unsqueeze(1) if args.mask_truncated_completions else completion_mask
        rollout = Rollout(round_index, prompt_ids.to(device), prompt_mask.to(device), completion_tensor.to(device),
                          completion_mask.to(device), loss_mask.to(device), finished.to(device), rewards.to(device))
        sampler_logps = sampler_logps_tensor(completions, completion_tensor.shape[1])
        if sampler_logps is not None:
            rollout.tensors["sampler_logps"] = sampler_logps.to(device)
        self.attach_rollout_tensors(rollout)
        all_rewards = self.accelerator.gather(rollout.rewards)
        rollout.tensors["advantages"] = self.compute_advantages(all_rewards, rollout)
        rollout.step_tokens = self._step_token_totals(rollout)

        self._record_round(rollout, all_rewards, self.accelerator.gather(per_function.to(device)),
                           generation_seconds, scoring_seconds)
        if args.log_completions:
            self._log_completions(prompts, texts, rewards.tolist())
        return rollout

    def attach_rollout_tensors(self, rollout: Rollout) -> None:
        """Adds the tensors computed from the policy before the update: old log-probs (when the policy will
        have changed by the time a micro-batch is trained) and reference log-probs (beta > 0)."""
        if self.needs_old_logps:
            rollout.tensors["old_logps"] = self._rollout_logps(rollout, unwrap(self.model))
        if self.args.beta > 0:
            with reference_forward(self.model, self.ref_model) as reference:
                rollout.tensors["ref_logps"] = self._rollout_logps(rollout, reference)

    @torch.no_grad()
    def _rollout_logps(self, rollout: Rollout, model) -> torch.Tensor:
        """Log-probs [N, T] of all completions of the rollout, computed in micro-batches."""
        logps = torch.zeros(rollout.completion_ids.shape, device=rollout.completion_ids.device)
        size = self.args.per_device_train_batch_size
        for start in range(0, len(rollout), size):
            chunk, _ = self.completion_logps(model, rollout.batch(start, start + size))
            logps[start:start + size, :chunk.shape[1]] = chunk
        return logps

    def compute_advantages(self, rewards: torch.Tensor, rollout: Rollout) -> torch.Tensor:
        """The method's advantages for this process's completions, [N] or per token [N, T].

        `rewards` [num_processes * N] are the round's rewards over all processes in prompt order (NaN where
        no reward function applies); `rollout` is this process's share, with its tensors attached.
        """
        raise NotImplementedError

    def local_share(self, values: torch.Tensor) -> torch.Tensor:
        """This process's rows of a tensor gathered over processes (in process order)."""
        size = values.shape[0] // self.accelerator.num_processes
        return values[self.accelerator.process_index * size:][:size]

    def _step_token_totals(self, rollout: Rollout) -> list[float]:
        """Loss tokens of each optimizer step of the round, summed over processes (aggregate_loss's totals)."""
        per_step = self.args.per_device_train_batch_size * self.args.gradient_accumulation_steps
        local = rollout.loss_mask.sum(1).view(-1, per_step).sum(1).float()
        return self.accelerator.gather(local).view(-1, local.numel()).sum(0).tolist()

    # -- metrics and logs ----------------------------------------------------------------------------------
    def _record_round(self, rollout: Rollout, rewards: torch.Tensor, per_function: torch.Tensor,
                      generation_seconds: float, scoring_seconds: float) -> None:
        """Round metrics over all processes (the gathered tensors are the same on every process)."""
        gather = self.accelerator.gather
        lengths = gather(rollout.completion_mask.sum(1)).float()
        advantages = gather(rollout.tensors["advantages"])
        if advantages.dim() == 2:  # per-token advantages: statistics over the trained tokens
            advantages = advantages[gather(rollout.loss_mask).bool()]
        groups = rewards.view(-1, self.args.num_generations)
        zero_std = [bool(nanstd(group) == 0) for group in groups]
        clipped = ~gather(rollout.finished)
        metrics = {
            "reward": rewards.nanmean(), "reward_std": nanstd(rewards),
            "frac_reward_zero_std": sum(zero_std) / len(zero_std), "frac_reward_none": rewards.isnan().float().mean(),
            "advantages/mean": advantages.mean(), "advantages/std": nanstd(advantages),
            "completions/mean_length": lengths.mean(), "completions/min_length": lengths.min(),
            "completions/max_length": lengths.max(), "completions/clipped_ratio": clipped.float().mean(),
            "time/generation": generation_seconds, "time/scoring": scoring_seconds,
        }
        for i, name in enumerate(self.reward_scorer.names):
            metrics[f"rewards/{name}/mean"] = per_function[:, i].nanmean()
            metrics[f"rewards/{name}/std"] = nanstd(per_function[:, i])
        for key, value in metrics.items():
            self._metrics["train"][key].append(float(value))

    def _log_completions(self, prompts: list, texts: list[str], rewards: list[float]) -> None:
        records = [{"step": self.state.global_step, "prompt": prompt, "completion": text,
                    "reward": None if math.isnan(reward) else reward}
                   for prompt, text, reward in zip(prompts, texts, rewards)]
        records = gather_object(records)
        if self.accelerator.is_main_process:
            path = Path(self.args.output_dir) / COMPLETIONS_LOG
            path.parent.mkdir(parents=True, exist_ok=True)
            with path.open("a", encoding="utf-8") as file:
                file.writelines(json.dumps(record, ensure_ascii=False) + "\n" for record in records)
