"""Multi-turn episodes for the online engine: tool calling (`tools=`), environments (`environment_factory=`) and
user-supplied rollouts (`rollout_func=`), each producing the same `Episode` records as single-turn sampling.

A tool episode alternates model turns and tool turns:

    prompt ids ─► sample turn 1 ─► parse calls ─► run tools ─► tool-turn ids ─► sample turn 2 (from the ids so far)
                 ─► ... until a turn makes no call, max_tool_calling_iterations, or max_completion_length

The episode's tokens are the sampled ids as they came out of the sampler plus each tool turn as the chat template
renders it, tokenized on its own; the model's tokens are never decoded and re-encoded. `model_mask` is 0 on tool-
turn tokens, so they get no loss, KL or entropy and don't count in length normalisation. As in TRL 1.16, the whole
completion (all turns) stays within max_completion_length: a tool turn that would not fit ends the episode as it
was, and the last turn is cut to fit. A call that cannot run (unreadable, unknown tool, bad arguments, an
exception, a timeout) becomes a tool message the model reads; it never ends the run.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

from posttrain.errors import ConfigError, DataError
from posttrain.generation import derive_seed
from posttrain.online.rollout import Episode
from posttrain.tools import (
    WITH_SPECIAL_TOKENS,
    EnvironmentPool,
    ToolExecutor,
    ToolStats,
    check_calls,
    check_template_renders_tools,
    has_response_schema,
    parse_tool_calls,
    parse_with_response_schema,
    prompt_with_observation,
    regex_parser_for,
    tool_schemas,
    tool_suffix_ids,
)

__all__ = ["CustomRollouts", "ToolRollouts", "make_episode_source"]


@dataclasses.dataclass
class _Running:
    """An episode being sampled."""

    prompt_ids: list[int]
    seed: int
    executor: ToolExecutor
    schemas: list[dict]
    episode: Episode
    turn_start: int = 0  # where the last model turn starts in episode.token_ids
    environment: Any = None


class ToolRollouts:
    """Samples tool-calling episodes with a generation backend. `tools` are offered to every episode;
    `environments` (an EnvironmentPool) give each episode its own environment and its methods as more tools."""

    def __init__(
        self,
        backend,
        tokenizer,
        tools: Sequence[Callable],
        environments: EnvironmentPool | None,
        max_completion_length: int,
        max_iterations: int | None,
        parser: str | Callable = "auto",
        timeout: float | None = 30.0,
        template_kwargs: dict | None = None,
    ) -> None:
        self.backend, self.tokenizer, self.tools, self.environments = backend, tokenizer, list(tools), environments
        self.max_completion_length = max_completion_length
        self.max_iterations = max_iterations
        self.timeout, self.template_kwargs = timeout, dict(template_kwargs or {})
        # "auto": the tokenizer's response template, with the regex parser of its chat template as the fallback
        self.use_schema = parser == "auto" and has_response_schema(tokenizer)
        self.parser = regex_parser_for(tokenizer) if parser == "auto" else parser
        self.executor = ToolExecutor(self.tools, timeout=timeout) if self.tools else None
        self.schemas = tool_schemas(self.tools)
        self.stats = ToolStats()

    def render_prompt(self, prompt: list[dict], schemas: list[dict]) -> list[int]:
        text = self.tokenizer.apply_chat_template(
            prompt, tools=schemas or None, add_generation_prompt=True, tokenize=False, **self.template_kwargs
        )
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def generate(
        self, rows: list[dict], prompt_ids: list[list[int]], n: int, sampling, seeds: list[int], prompt_column: str
    ) -> list[Episode]:
        if self.environments is None:
            first = self.backend.generate(prompt_ids, n, sampling, seed=seeds)
            running = [
                _Running(
                    prompt_ids[i // n],
                    derive_seed(seeds[i // n], i % n),
                    self.executor,
                    self.schemas,
                    Episode.single_turn(c),
                )
                for i, c in enumerate(first)
            ]
        else:
            running = self._start_environments(rows, n, sampling, seeds, prompt_column)
        for episode in (r.episode for r in running):
            episode.info.update(turns=1, tool_calls=0, tool_failures=0)
            episode.messages = []
        active = running
        for iteration in range(self.max_iterations if self.max_iterations is not None else 1 << 30):
            active = [r for r in active if self._answer_calls(r)]
            if not active:
                break
            self._continue(active, sampling, iteration + 1)
        for r in running:
            self._close(r)
        return [r.episode for r in running]

    def _start_environments(self, rows, n, sampling, seeds, prompt_column) -> list[_Running]:
        rollout_rows = [row for row in rows for _ in range(n)]
        started = self.environments.start(
            [{k: v for k, v in row.items() if not k.startswith("prompt_ids")} for row in rollout_rows]
        )
        running = []
        for i, (row, env) in enumerate(zip(rollout_rows, started)):
            prompt = row.get(prompt_column)
            if prompt is not None and not isinstance(prompt, list):
                raise DataError(
                    f"environment_factory needs conversational prompts (lists of messages); row "
                    f"{i // n} has {type(prompt).__name__} in column {prompt_column!r}."
                )
            schemas = tool_schemas(env.tools)
            ids = self.render_prompt(prompt_with_observation(prompt, env.observation), schemas)
            running.append(
                _Running(
                    ids,
                    derive_seed(seeds[i // n], i % n),
                    ToolExecutor(env.tools, self.timeout),
                    schemas,
                    Episode([], [], None, False),
                    environment=env,
                )
            )
        first = self.backend.generate([r.prompt_ids for r in running], 1, sampling, seed=[r.seed for r in running])
        for r, completion in zip(running, first):
            r.episode = dataclasses.replace(Episode.single_turn(completion), prompt_ids=r.prompt_ids)
            r.episode.reward_kwargs["environments"] = r.environment.environment
        return running

    def _last_turn_text(self, r: _Running, special_tokens: bool = False) -> str:
        return self.tokenizer.decode(r.episode.token_ids[r.turn_start :], skip_special_tokens=not special_tokens)

    def _parse_last_turn(self, r: _Running):
        """The last turn's calls: by the tokenizer's response template when it has one and reads the turn, else by
        the regex parser (on the text with special tokens where its markers are special tokens)."""
        tools = list(r.executor.tools.values())
        if self.use_schema:
            turn_ids = r.episode.token_ids[r.turn_start :]
            turn = parse_with_response_schema(
                self.tokenizer, turn_ids, r.prompt_ids + r.episode.token_ids[: r.turn_start], tools
            )
            if turn is not None:
                return check_calls(turn, tools)
        text = self._last_turn_text(r, special_tokens=self.parser in WITH_SPECIAL_TOKENS)
        return parse_tool_calls(text, self.parser, tools=tools)

    def _answer_calls(self, r: _Running) -> bool:
        """Runs the calls of the episode's last turn and appends the tool turn's ids; False when the episode
        ends here (no call, the environment is done, or the tool turn would not fit)."""
        episode = r.episode
        if not episode.finished or (r.environment is not None and self.environments.is_done(r.environment)):
            return False
        turn = self._parse_last_turn(r)
        if not turn.has_calls:
            return False
        results = r.executor.run(turn)
        self.stats = self.stats + ToolStats.of(results)
        episode.info["tool_calls"] += sum(result.counts_as_call for result in results)
        episode.info["tool_failures"] += sum(result.failed for result in results)
        tool_messages = [result.message for result in results]
        suffix = tool_suffix_ids(self.tokenizer, tool_messages, tools=r.schemas or None, **self.template_kwargs)
        if len(episode.token_ids) + len(suffix) >= self.max_completion_length:
            return False  # as in TRL: the tool turn does not fit, the episode ends as it was
        episode.messages += [
            {"role": "assistant", "content": turn.content, "tool_calls": [c.as_message_call() for c in turn.calls]},
            *tool_messages,
        ]
        episode.token_ids += suffix
        episode.model_mask += [0] * len(suffix)
        if episode.logprobs is not None:
            episode.logprobs += [0.0] * len(suffix)
        r.turn_start = len(episode.token_ids)
        return True

    def _continue(self, active: list[_Running], sampling, turn: int) -> None:
        """Samples the next model turn of every active episode from its ids so far, in one batch."""
        budgets = [self.max_completion_length - len(r.episode.token_ids) for r in active]
        continued = self.backend.generate(
            [r.prompt_ids + r.episode.token_ids for r in active],
            1,
            dataclasses.replace(sampling, max_tokens=max(budgets)),
            seed=[derive_seed(r.seed, turn) for r in active],
        )
        for r, completion, budget in zip(active, continued, budgets):
            ids = list(completion.token_ids)[:budget]
            episode = r.episode
            episode.token_ids += ids
            episode.model_mask += [1] * len(ids)
            if episode.logprobs is not None:
                episode.logprobs += list(completion.logprobs or [0.0] * len(ids))[:budget]
            episode.finished = completion.finished_with_eos and len(completion.token_ids) <= budget
            episode.info["turns"] += 1

    def _close(self, r: _Running) -> None:
        """The final model turn as a message (reward functions read the whole conversation); a plain completion
        keeps messages=None (the engine gives the reward functions its text)."""
        episode = r.episode
        if not episode.messages:
            episode.messages = None
            return
        episode.messages.append({"role": "assistant", "content": self._last_turn_text(r)})


class CustomRollouts:
    """TRL's `rollout_func(prompts, trainer) -> dict`: the user samples the episodes. `prompts` holds one entry
    per episode (each prompt num_generations times in a row); the dict has per-episode lists `prompt_ids`,
    `completion_ids` and `logprobs`, optionally `env_mask` (1 on the model's tokens, 0 on external ones), and
    any other key is passed on to the reward functions."""

    REQUIRED = ("prompt_ids", "completion_ids", "logprobs")

    def __init__(self, rollout_func: Callable, trainer, stop_ids: Sequence[int]) -> None:
        self.rollout_func, self.trainer, self.stop_ids = rollout_func, trainer, set(stop_ids)

    def generate(self, rows: list[dict], prompt_ids, n: int, sampling, seeds, prompt_column: str) -> list[Episode]:
        prompts = [row[prompt_column] for row in rows for _ in range(n)]
        output = self.rollout_func(prompts, self.trainer)
        missing = [key for key in self.REQUIRED if not isinstance(output, dict) or key not in output]
        if missing:
            raise DataError(f"rollout_func must return a dict with the keys {list(self.REQUIRED)}; it lacks {missing}.")
        output = dict(output)
        masks = output.pop("env_mask", None)
        output.pop("logprob_token_ids", None)
        prompt_ids, completion_ids, logprobs = (output.pop(key) for key in self.REQUIRED)
        for key, values in {"prompt_ids": prompt_ids, "completion_ids": completion_ids, **output}.items():
            if len(values) != len(prompts):
                raise DataError(
                    f"rollout_func returned {len(values)} entries under {key!r} for {len(prompts)} "
                    f"episodes ({len(rows)} prompts x num_generations {n}); return one per episode."
                )
        episodes = []
        for i, ids in enumerate(completion_ids):
            ids = list(ids)
            mask = [1] * len(ids) if masks is None else [int(m) for m in masks[i]]
            if len(mask) != len(ids) or (
                logprobs is not None and logprobs[i] is not None and len(logprobs[i]) != len(ids)
            ):
                raise DataError(
                    f"rollout_func episode {i}: env_mask / logprobs must have one entry per completion "
                    f"token ({len(ids)})."
                )
            episodes.append(
                Episode(
                    ids,
                    mask,
                    None if logprobs is None or logprobs[i] is None else list(logprobs[i]),
                    bool(ids) and ids[-1] in self.stop_ids,
                    prompt_ids=list(prompt_ids[i]),
                    reward_kwargs={key: values[i] for key, values in output.items()},
                )
            )
        return episodes


def make_episode_source(trainer, tools, environments: EnvironmentPool | None, rollout_func):
    """The trainer's multi-turn generator (None for plain sampling), checked before training."""
    if not tools and environments is None and rollout_func is None:
        return None
    args = trainer.args
    if rollout_func is not None:
        if tools or environments is not None:
            raise ConfigError(
                "rollout_func samples the episodes itself; it cannot be combined with tools= or "
                "environment_factory= here. Call the tools inside rollout_func, or drop it."
            )
        from posttrain.generation import stop_token_ids

        return CustomRollouts(rollout_func, trainer, stop_token_ids(trainer.processing_class, trainer.model))
    if not trainer.conversational:
        raise DataError(
            "tools= and environment_factory= need conversational prompts (a 'prompt' column of message "
            "lists) so that the chat template can show the tools; convert the prompts to messages."
        )
    # each prompt shows its own environment's tools (two environments may name a tool alike)
    offered = [list(tools or ())] if environments is None else list(environments.tool_schemas.values())
    for tool_set in offered:
        check_template_renders_tools(trainer.processing_class, tool_set)
    return ToolRollouts(
        trainer.generation_backend,
        trainer.processing_class,
        tools or (),
        environments,
        args.max_completion_length,
        args.max_tool_calling_iterations,
        args.tool_call_parser,
        args.tool_timeout_s,
        args.chat_template_kwargs,
    )
