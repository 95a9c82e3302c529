"""Scoring a batch of completions with reward functions and reward models: the plumbing of the online trainers.

A reward function is any callable `f(prompts, completions, completion_ids, **columns, trainer_state=...,
log_metric=..., log_extra=...)` that returns one float per completion, or None where it does not apply. It is called
with keyword arguments and gets only those its signature names (all of them if it takes `**kwargs`), so a function
asks for exactly the dataset columns it needs. `async def` functions run concurrently on a background event loop,
each under a time limit; plain functions run in the calling thread (math-verify's timeouts need the main thread). A
reward model (a sequence classifier with one label, or its name/path) is wrapped into such a function that scores
prompt + completion. `log_metric(name, value)` (TRL's) records a number of the function's own, logged with the
trainer's metrics (averaged over the logging window); `log_extra(column, values)` (TRL's) adds a column of one value
per completion to the completion log (completions.jsonl, with log_completions=True).
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import logging
import math
import numbers
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from posttrain.data.chat import render, require_chat_template
from posttrain.errors import ConfigError, DataError, PosttrainError
from posttrain.models.loading import load_sequence_classifier, load_tokenizer

logger = logging.getLogger("posttrain")
FAILURE_POLICIES = ("error", "skip")  # what a failing reward function does to the run

# Keyword arguments every reward function may ask for; dataset columns are passed beside them by name.
STANDARD_ARGUMENTS = ("prompts", "completions", "completion_ids", "trainer_state", "log_metric", "log_extra")
_PER_BATCH = ("trainer_state", "log_metric", "log_extra")  # arguments that are not one value per sample


def _ignore_metric(name: str, value: float) -> None:
    """log_metric where no trainer records metrics (a scorer used on its own)."""


class _ExtraColumns:
    """log_extra(column, values): checks there is one value per completion, then hands the column on (or drops it
    where no trainer logs completions)."""

    def __init__(self, sink: Callable[[str, list], None] | None, count: int) -> None:
        self.sink, self.count = sink, count

    def __call__(self, column: str, values) -> None:
        values = list(values)
        if len(values) != self.count:
            raise DataError(f"log_extra({column!r}, ...) got {len(values)} values for {self.count} completions.")
        if self.sink is not None:
            self.sink(column, values)


class RewardFunctionError(RuntimeError):
    """A reward function raised, or returned something other than one finite float (or None) per sample."""


class RewardTimeoutError(TimeoutError):
    """An async reward function ran past `timeout_s` (a TimeoutError the function raises itself is not one)."""


@dataclass(frozen=True)
class _Reward:
    name: str
    func: Callable[..., Any]
    is_async: bool
    accepts_all: bool  # takes **kwargs
    accepted: frozenset[str]
    required: tuple[str, ...]

    def select(self, kwargs: dict[str, Any]) -> dict[str, Any]:
        """The keyword arguments this function's signature takes."""
        if self.accepts_all:
            return kwargs
        return {key: value for key, value in kwargs.items() if key in self.accepted}


def _make_reward(name: str, func: Callable[..., Any]) -> _Reward:
    try:
        parameters = inspect.signature(func).parameters.values()
    except (TypeError, ValueError):  # some builtins and C callables have no signature: pass everything
        return _Reward(name, func, _is_async(func), True, frozenset(), ())
    by_keyword = [p for p in parameters if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    return _Reward(
        name=name,
        func=func,
        is_async=_is_async(func),
        accepts_all=any(p.kind == p.VAR_KEYWORD for p in parameters),
        accepted=frozenset(p.name for p in by_keyword),
        required=tuple(p.name for p in by_keyword if p.default is p.empty),
    )


def _is_async(func: Callable[..., Any]) -> bool:
    """A coroutine function, or an object whose __call__ is one."""
    return inspect.iscoroutinefunction(func) or (callable(func) and inspect.iscoroutinefunction(func.__call__))


def get_callable_name(func: Callable[..., Any]) -> str:
    """The name a reward's metrics take: a function's `__name__` (through `functools.partial` wrappers), else the
    callable object's class name."""
    while isinstance(func, functools.partial):
        func = func.func
    return getattr(func, "__name__", type(func).__name__)


def _unique(names: list[str]) -> list[str]:
    """Names made unique with a suffix (`f`, `f_2`, ...), since metrics are logged per name."""
    seen: dict[str, int] = {}
    unique = []
    for name in names:
        seen[name] = seen.get(name, 0) + 1
        unique.append(name if seen[name] == 1 else f"{name}_{seen[name]}")
    return unique


def _excerpt(prompt: Any, limit: int = 60) -> str:
    """The prompt as error messages show it: the last message's content if conversational, shortened."""
    if isinstance(prompt, list) and prompt and isinstance(prompt[-1], dict):
        prompt = prompt[-1].get("content", prompt)
    text = prompt if isinstance(prompt, str) else repr(prompt)
    return repr(text if len(text) <= limit else text[:limit] + "...")


class _ModelReward:
    """A sequence classifier as a reward function: the score of prompt + completion is logit 0 of its last token.

    Conversations are rendered with the reward model's own chat template (its special tokens are in the
    template); plain text is prompt + completion tokenized with the tokenizer's special tokens, as a reward
    model trained on standard text saw it. Batches are right-padded, so positions match an unpadded forward.
    """

    def __init__(self, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> None:
        self.model = model.eval()
        self.tokenizer = tokenizer

    def __call__(self, prompts: list, completions: list) -> list[float]:
        conversational = isinstance(prompts[0], list)
        if conversational:
            require_chat_template(
                self.tokenizer, f"scoring conversations with the reward model {self.model.name_or_path!r}"
            )
            texts = [
                render(self.tokenizer, prompt + self._messages(completion))
                for prompt, completion in zip(prompts, completions)
            ]
        else:
            texts = [prompt + completion for prompt, completion in zip(prompts, completions)]
        batch = self.tokenizer(
            texts, padding=True, padding_side="right", add_special_tokens=not conversational, return_tensors="pt"
        )
        with torch.no_grad():
            logits = self.model(
                input_ids=batch["input_ids"].to(self.model.device),
                attention_mask=batch["attention_mask"].to(self.model.device),
            ).logits
        return logits[:, 0].float().tolist()

    @staticmethod
    def _messages(completion: str | list[dict]) -> list[dict]:
        return completion if isinstance(completion, list) else [{"role": "assistant", "content": completion}]


def _shards_frozen_models(accelerator: Any) -> bool:
    from posttrain.runtime.distributed import frozen_model_sharding  # lazily: the trainers import this module

    return frozen_model_sharding(accelerator) is not None


_loop: asyncio.AbstractEventLoop | None = None
_loop_lock = threading.Lock()


def _event_loop() -> asyncio.AbstractEventLoop:
    """The event loop that runs every async reward function, started once in a daemon thread.

    A private loop works whether or not the caller is inside one of its own (e.g. a notebook's).
    """
    global _loop
    with _loop_lock:
        if _loop is None:
            loop = asyncio.new_event_loop()
            threading.Thread(target=loop.run_forever, name="posttrain-async-rewards", daemon=True).start()
            _loop = loop
    return _loop


class RewardScorer:
    """Calls every reward function on a batch and combines their rewards with weights.

    `reward_funcs` entries are callables (sync or `async def`), sequence-classifier models, or a model's name or
    path (loaded with one output label and its own tokenizer, `reward_processing_classes[i]` or the one saved
    with it). `timeout_s` bounds each async function's call; sync functions run to completion. An async function
    must not block the event loop it shares with the others (run blocking work with `asyncio.to_thread`).

    Calling the scorer returns `rewards [N, F]` (NaN where a function returned None) and the weighted sum
    `[N]` over the functions that apply to each sample. A sample no function applies to gets a total of NaN:
    the engine must treat it as carrying no learning signal (advantage 0, excluded from its group's
    statistics) and should count it in its metrics. A batch where no function applies to any sample is an
    error, since it almost always means the dataset lacks the columns the rewards read.
    """

    def __init__(
        self,
        reward_funcs: list,
        reward_weights: list[float] | None = None,
        reward_processing_classes: list | None = None,
        timeout_s: float = 60.0,
        failure_policy: str = "error",
    ) -> None:
        if failure_policy not in FAILURE_POLICIES:
            raise ConfigError(
                f"reward_failure_policy={failure_policy!r} is not one of {FAILURE_POLICIES}: 'error' stops "
                "the run at a failing reward function, 'skip' scores the batch without it and counts it."
            )
        self.failure_policy = failure_policy
        self.faults: dict[str, int] = {}  # failures per reward function since `pop_faults` (failure_policy='skip')
        if not reward_funcs:
            raise ConfigError(
                "No reward functions given; pass at least one function, model or model path in reward_funcs."
            )
        count = len(reward_funcs)
        if reward_processing_classes is not None and not isinstance(reward_processing_classes, (list, tuple)):
            reward_processing_classes = [reward_processing_classes]  # one tokenizer for one reward model, as TRL
        processing_classes = self._check_length(reward_processing_classes, count, "reward_processing_classes")
        weights = self._check_length(reward_weights, count, "reward_weights") or [1.0] * count
        for i, weight in enumerate(weights):
            if not isinstance(weight, numbers.Real) or not math.isfinite(weight):
                raise ConfigError(f"reward_weights[{i}]={weight!r} is not a finite number.")
        if timeout_s <= 0:
            raise ConfigError(f"timeout_s={timeout_s} must be positive (seconds an async reward function may take).")
        processing_classes = processing_classes or [None] * count
        funcs, names = zip(
            *(
                self._load(entry, processing_class, i)
                for i, (entry, processing_class) in enumerate(zip(reward_funcs, processing_classes))
            )
        )
        self.names: list[str] = _unique(list(names))
        self.funcs: list = list(funcs)  # as given: functions, reward models (loaded from a name), callables
        # per function: a reward model's tokenizer (given or loaded), None for a function (TRL's attribute)
        self.processing_classes = [f.tokenizer if isinstance(f, _ModelReward) else None for f in funcs]
        for func in funcs:  # code-running rewards: a missing sandbox stops the run now, not at the first reward
            if getattr(func, "sandbox", None) is not None:
                from posttrain.rewards.sandbox import check_sandbox

                check_sandbox(func.sandbox)
        self._rewards = [_make_reward(name, func) for name, func in zip(self.names, funcs)]
        self.weights = torch.tensor(weights, dtype=torch.float32)
        self.timeout_s = timeout_s

    @staticmethod
    def _check_length(values: list | None, count: int, setting: str) -> list | None:
        if values is not None and len(values) != count:
            raise ConfigError(
                f"The number of {setting} ({len(values)}) must match the number of reward functions ({count}); "
                f"give one per reward function, in the same order."
            )
        return values

    @staticmethod
    def _load(entry: Any, processing_class: Any, index: int) -> tuple[Callable[..., Any], str]:
        """The callable and the name for `reward_funcs[index]`."""
        if isinstance(entry, (str, PreTrainedModel)):
            tokenizer = load_tokenizer(entry, processing_class)
            model = load_sequence_classifier(entry, num_labels=1, tokenizer=tokenizer)
            name = entry if isinstance(entry, str) else (model.name_or_path or type(model).__name__)
            return _ModelReward(model, tokenizer), name
        if not callable(entry):
            raise ConfigError(
                f"reward_funcs[{index}] is a {type(entry).__name__}; give a function, a sequence "
                "classifier model, or a reward model's name or path."
            )
        if processing_class is not None:
            raise ConfigError(
                f"reward_processing_classes[{index}] is set, but reward_funcs[{index}] "
                f"({get_callable_name(entry)}) is a function, not a model; set that entry to None."
            )
        return entry, get_callable_name(entry)

    def to(self, device: torch.device | str, accelerator: Any = None) -> RewardScorer:
        """Moves the reward models to `device` (the policy's, usually); functions are unaffected. With the
        trainer's `accelerator`, each is placed as a frozen model (`prepare_model(..., evaluation_mode=True)`):
        under DeepSpeed ZeRO-3 and FSDP2 it is sharded like the policy (posttrain/runtime/distributed.py)."""
        for reward in self._rewards:
            if isinstance(reward.func, _ModelReward):
                reward.func.model.to(device)
                if accelerator is not None and _shards_frozen_models(accelerator):
                    reward.func.model = accelerator.prepare_model(reward.func.model, evaluation_mode=True)
        return self

    def check_columns(self, columns: list[str]) -> None:
        """Fails early if a reward function needs an argument that neither the trainer nor the dataset gives."""
        shadowing = sorted(set(columns) & set(STANDARD_ARGUMENTS))
        if shadowing:
            raise DataError(
                f"Dataset column(s) {shadowing} have the name of a standard reward function argument "
                f"({', '.join(STANDARD_ARGUMENTS)}); rename them (dataset.rename_column)."
            )
        available = set(STANDARD_ARGUMENTS) | set(columns)
        for reward in self._rewards:
            missing = [name for name in reward.required if name not in available]
            if missing:
                raise DataError(
                    f"Reward function '{reward.name}' has a required parameter '{missing[0]}' that is neither a "
                    f"standard argument ({', '.join(STANDARD_ARGUMENTS)}) nor a dataset column (columns: "
                    f"{sorted(columns)}). Add a '{missing[0]}' column to the dataset or give the parameter a "
                    "default value."
                )

    def __call__(
        self,
        prompts: list,
        completions: list,
        completion_ids: list[list[int]],
        columns: dict[str, list],
        trainer_state: Any = None,
        log_metric: Callable[[str, float], None] | None = None,
        log_extra: Callable[[str, list], None] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`rewards [N, F]` (float32, NaN = not applicable) and their weighted nansum `[N]` (NaN if none applies).

        Row i of every input (and of every column) belongs to completion i; a prompt is repeated once per
        generation.
        """
        self.check_columns(list(columns))
        self._check_lengths(prompts, completions, completion_ids, columns)
        kwargs = {
            "prompts": prompts,
            "completions": completions,
            "completion_ids": completion_ids,
            **columns,
            "trainer_state": trainer_state,
            "log_metric": log_metric or _ignore_metric,
            "log_extra": _ExtraColumns(log_extra, len(prompts)),
        }
        async_rewards = [reward for reward in self._rewards if reward.is_async]
        # The async functions start first so that they run while the sync functions run here.
        pending = (
            asyncio.run_coroutine_threadsafe(self._gather(async_rewards, kwargs), _event_loop())
            if async_rewards
            else None
        )
        outputs: dict[str, Any] = {}
        for reward in self._rewards:
            if not reward.is_async:
                try:
                    outputs[reward.name] = self._call_one(reward, kwargs)
                except PosttrainError:  # already says what is wrong with the data or settings
                    raise
                except Exception as error:
                    outputs[reward.name] = self._fault(reward, kwargs, error)
        if pending is not None:
            for reward, output in zip(async_rewards, pending.result()):
                if isinstance(output, PosttrainError) and not isinstance(output, RewardTimeoutError):
                    raise output
                outputs[reward.name] = self._fault(reward, kwargs, output) if isinstance(output, Exception) else output
        columns = []
        for reward in self._rewards:
            try:
                columns.append(self._check_output(reward, outputs[reward.name], prompts))
            except RewardFunctionError as error:
                columns.append(self._fault(reward, kwargs, error))
        rewards = torch.tensor(
            [[math.nan if v is None else v for v in column] for column in columns], dtype=torch.float32
        ).T
        not_applicable = rewards.isnan()
        if not_applicable.all() and not any(self.faults.values()):
            raise DataError(
                f"No reward function applies to this batch: {', '.join(self.names)} returned None for all "
                f"{len(prompts)} samples. Check that the dataset has the columns these rewards read and that "
                "they suit its task."
            )
        total = torch.nansum(rewards * self.weights, dim=1)
        total[not_applicable.all(dim=1)] = math.nan
        return rewards, total

    @staticmethod
    def _check_lengths(prompts: list, completions: list, completion_ids: list, columns: dict[str, list]) -> None:
        lengths = {
            "completions": len(completions),
            "completion_ids": len(completion_ids),
            **{f"column '{name}'": len(values) for name, values in columns.items()},
        }
        wrong = [f"{name} has {length}" for name, length in lengths.items() if length != len(prompts)]
        if wrong:
            raise DataError(
                f"Reward inputs disagree in length: {len(prompts)} prompts, but {', '.join(wrong)}; "
                "give one row per completion (each prompt's row repeated once per generation)."
            )

    async def _gather(self, rewards: list[_Reward], kwargs: dict[str, Any]) -> list[Any]:
        """Every function's output, or the exception it raised, in order."""
        return await asyncio.gather(*(self._await(reward, kwargs) for reward in rewards), return_exceptions=True)

    async def _await(self, reward: _Reward, kwargs: dict[str, Any]) -> Any:
        task = asyncio.ensure_future(reward.func(**reward.select(kwargs)))
        done, _ = await asyncio.wait({task}, timeout=self.timeout_s)
        if not done:
            task.cancel()
            raise RewardTimeoutError(
                f"Async reward function '{reward.name}' did not finish within timeout_s={self.timeout_s} s on a "
                f"batch of {len(kwargs['prompts'])} samples; make it faster or raise the timeout."
            )
        return task.result()

    def _call_one(self, reward: _Reward, kwargs: dict[str, Any]) -> Any:
        if not reward.is_async:
            return reward.func(**reward.select(kwargs))
        return asyncio.run_coroutine_threadsafe(self._await(reward, kwargs), _event_loop()).result()

    def _fault(self, reward: _Reward, kwargs: dict[str, Any], error: Exception) -> list[None]:
        """A failing reward function (it raised, timed out, or returned something unusable): the error that stops
        the run, or with failure_policy='skip' no reward from it for this batch, counted in `faults`."""
        if self.failure_policy == "error":
            if isinstance(error, (RewardTimeoutError, RewardFunctionError)):
                raise error
            raise self._failure(reward, kwargs, error) from error
        logger.warning(
            "Reward function '%s' failed on this batch and is skipped for it (reward_failure_policy='skip'): %s: %s",
            reward.name,
            type(error).__name__,
            error,
        )
        self.faults[reward.name] = self.faults.get(reward.name, 0) + 1
        return [None] * len(kwargs["prompts"])

    def pop_faults(self) -> dict[str, int]:
        """Failures per reward function since the last call (all functions listed, 0 where none)."""
        faults, self.faults = self.faults, {}
        return {name: faults.get(name, 0) for name in self.names}

    def _failure(self, reward: _Reward, kwargs: dict[str, Any], error: Exception) -> RewardFunctionError:
        """The error to raise when `reward` raised on the batch, naming the first sample that fails on its own.

        The function is rerun one sample at a time to find it; training stops here anyway.
        """
        for i in range(len(kwargs["prompts"])):
            sample = {key: value if key in _PER_BATCH else value[i : i + 1] for key, value in kwargs.items()}
            sample["log_extra"] = _ExtraColumns(None, 1)  # one sample: its extra columns are not logged
            try:
                self._call_one(reward, sample)
            except Exception as sample_error:  # noqa: BLE001 - any error is the one to report
                return RewardFunctionError(
                    f"Reward function '{reward.name}' failed on sample {i} (prompt: "
                    f"{_excerpt(kwargs['prompts'][i])}): {type(sample_error).__name__}: {sample_error}"
                )
        return RewardFunctionError(
            f"Reward function '{reward.name}' failed on a batch of {len(kwargs['prompts'])} samples (each sample "
            f"alone succeeds): {type(error).__name__}: {error}"
        )

    @staticmethod
    def _check_output(reward: _Reward, output: Any, prompts: list) -> list[float]:
        """`output` as floats with NaN for None, after checking it holds one finite number or None per sample."""
        if not isinstance(output, (list, tuple)) or len(output) != len(prompts):
            got = f"{len(output)} values" if isinstance(output, (list, tuple)) else f"a {type(output).__name__}"
            raise RewardFunctionError(
                f"Reward function '{reward.name}' returned {got} for {len(prompts)} samples; return a list with "
                "one float (or None where it does not apply) per completion."
            )
        values = []
        for i, value in enumerate(output):
            if value is None:
                values.append(math.nan)
                continue
            if not isinstance(value, numbers.Real) or not math.isfinite(value):
                problem = "a non-finite reward" if isinstance(value, numbers.Real) else f"a {type(value).__name__}"
                raise RewardFunctionError(
                    f"Reward function '{reward.name}' returned {problem} ({value!r:.80}) for sample {i} (prompt: "
                    f"{_excerpt(prompts[i])}); return a finite float, or None when the reward does not apply."
                )
            values.append(float(value))
        return values
