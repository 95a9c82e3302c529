"""OpenReward (ORS) environments as GRPO environments, with TRL's `trl.experimental.openreward` API.

An ORS server hosts an environment: a list of tasks per split, tools (shared ones, and per-task ones), and per
rollout a session that gives the task's prompt and runs tool calls, each answer possibly carrying a reward and a
"finished" flag. `OpenRewardSpec(target)` - an openreward.ai catalog name ("Eigent/SETA") or a server URL - gives
`.train_dataset` (one row per task: an empty user prompt, `task_index` and the task's spec fields),
`.environment_factory` (per rollout, an environment whose tool methods are the server's tools, posttrain's
`environment_factory=` contract: posttrain/tools/environment.py) and `.reward_funcs` (the last non-null reward of
each rollout, None when none came: an unscored rollout is not a scored zero).

The protocol (sessions, secrets, streaming) is the official `openreward` SDK's, which must be installed (`pip
install openreward`); without it, reading the spec's dataset or environment factory stops with a ConfigError
(before any trainer is built). The SDK itself needs the server (and, for the catalog, OPENREWARD_API_KEY).
"""

from __future__ import annotations

import inspect
import logging
import os
import re
from collections.abc import Callable
from functools import cached_property, partial
from typing import Any

from posttrain.errors import ConfigError

logger = logging.getLogger("posttrain")

_IDENTIFIER = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_JSON_TYPES = {"string": str, "integer": int, "number": float, "boolean": bool, "array": list, "object": dict}


def import_openreward():
    """The `openreward` SDK, or a ConfigError saying how to install it."""
    try:
        import openreward
    except ImportError:
        raise ConfigError(
            "OpenRewardSpec talks to an OpenReward (ORS) environment server through the `openreward` "
            "SDK, which is not installed here. Install it with `pip install openreward` (and set "
            "OPENREWARD_API_KEY for openreward.ai catalog environments)."
        ) from None
    return openreward


def _spec_dict(spec: Any) -> dict[str, Any]:
    """A tool spec (the SDK's ToolSpec or a dict) as {'name', 'description', 'input_schema'}."""
    if isinstance(spec, dict):
        return spec
    return {"name": spec.name, "description": spec.description, "input_schema": spec.input_schema or {}}


def _param_type(schema: dict[str, Any]) -> type:
    """The Python type of one JSON-schema property: its type, the non-null type of an anyOf/oneOf (Optional[T]), or
    the type of its default; str otherwise."""
    if schema.get("type") in _JSON_TYPES:
        return _JSON_TYPES[schema["type"]]
    for option in (schema.get("anyOf") or []) + (schema.get("oneOf") or []):
        if isinstance(option, dict) and option.get("type") in _JSON_TYPES:
            return _JSON_TYPES[option["type"]]
    default = schema.get("default")
    return type(default) if default is not None and type(default) in _JSON_TYPES.values() else str


def tool_method(spec: Any) -> Callable | None:
    """A method calling the server's tool `spec` through `self._call_tool`, with the typed signature and the
    Google-style docstring the tool schema is built from; None (with a warning) for a name that is not a Python
    identifier."""
    spec = _spec_dict(spec)
    name, schema = spec["name"], spec.get("input_schema") or {}
    properties, required = schema.get("properties") or {}, set(schema.get("required") or [])
    ordered = [p for p in properties if p in required] + [p for p in properties if p not in required]
    bad = [n for n in [name, *ordered] if not _IDENTIFIER.match(n)]
    if bad:
        logger.warning("OpenReward tool %r is skipped: %r is not a Python identifier.", name, bad[0])
        return None
    parameters = [inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD)]
    annotations, documented = {}, []
    for pname in ordered:
        annotations[pname] = _param_type(properties[pname])
        default = inspect.Parameter.empty if pname in required else properties[pname].get("default")
        parameters.append(
            inspect.Parameter(
                pname, inspect.Parameter.POSITIONAL_OR_KEYWORD, default=default, annotation=annotations[pname]
            )
        )
        text = properties[pname].get("description") or properties[pname].get("title") or pname
        documented.append(f"    {pname}: {' '.join(str(text).split())}")
    signature = inspect.Signature(parameters, return_annotation=str)

    def call(self, *args, **kwargs):
        bound = signature.bind(self, *args, **kwargs)
        bound.apply_defaults()
        return self._call_tool(name, {k: v for k, v in bound.arguments.items() if k != "self"})

    call.__name__ = call.__qualname__ = name
    call.__signature__ = signature
    call.__annotations__ = {**annotations, "return": str}
    description = " ".join(str(spec.get("description") or f"Call the {name} tool.").split())
    call.__doc__ = description + ("\n\nArgs:\n" + "\n".join(documented) if documented else "")
    return call


def _text(blocks: Any) -> str:
    """The text blocks (SDK objects or dicts with type 'text') joined by newlines; other blocks are skipped."""
    parts = []
    for block in blocks or []:
        kind = block.get("type") if isinstance(block, dict) else getattr(block, "type", None)
        text = block.get("text") if isinstance(block, dict) else getattr(block, "text", None)
        if kind == "text" and text:
            parts.append(str(text))
    return "\n".join(parts)


class OpenRewardEnvironment:
    """One rollout's ORS session. `reset(task_index=...)` opens it (closing the previous one) and returns the task's
    prompt; the tool methods (bound per spec on a subclass, see `OpenRewardSpec.environment_factory`) call the
    server. After the rollout: `reward` (the last non-null reward), `rewards` and `metadata` per tool call,
    `finished` and `last_output`."""

    def __init__(self, *, environment: Any, split: str = "train", secrets: dict[str, str] | None = None):
        self._environment, self._split, self._secrets = environment, split, secrets
        self._session_context = self._session = None
        self._clear()

    def _clear(self) -> None:
        self.reward: float | None = None
        self.rewards: list[float | None] = []
        self.metadata: list[dict | None] = []
        self.finished, self.last_output = False, ""

    def reset(self, task_index: int = 0, task_spec: dict | None = None, **row: Any) -> str:
        self._close()
        self._clear()
        if task_spec is not None:
            from openreward.api.environments.client import Task

            env = self._environment
            task = Task(server_name=env.server, environment_name=env.name, task_spec=task_spec, namespace=env.namespace)
            context = env.session(task=task, secrets=self._secrets)
        else:
            context = self._environment.session(split=self._split, index=int(task_index), secrets=self._secrets)
        self._session_context = context
        self._session = context.__enter__()
        return _text(self._session.get_prompt())

    def _close(self) -> None:
        """Ends the open session (the SDK's context exit deletes it on the server); failures are only logged."""
        if self._session_context is None:
            return
        try:
            self._session_context.__exit__(None, None, None)
        except Exception as error:  # noqa: BLE001 - a session that cannot be closed must not stop training
            logger.debug("Closing an OpenReward session failed: %s", error)
        self._session_context = self._session = None

    def _call_tool(self, name: str, arguments: dict[str, Any]) -> str:
        if self._session is None:
            raise RuntimeError(f"Tool {name} was called before reset() opened an OpenReward session.")
        try:
            output = self._session.call_tool(name, arguments)
        except Exception as error:  # noqa: BLE001 - a failing tool is the model's observation, as in TRL
            self.rewards.append(None)
            self.metadata.append(None)
            self.last_output = f"Error: {error}"
            return self.last_output
        try:
            reward = None if output.reward is None else float(output.reward)
        except (TypeError, ValueError):
            reward = None
        self.rewards.append(reward)
        if reward is not None:
            self.reward = reward
        self.metadata.append(output.metadata if isinstance(output.metadata, dict) else None)
        self.finished = bool(output.finished)
        self.last_output = _text(output.blocks) or "(no output)"
        return self.last_output


# Names a server tool cannot take: the environment's own methods and the state the reward function reads.
TAKEN_NAMES = frozenset({"reset", "get_reward", "reward", "rewards", "metadata", "finished", "last_output"})


def outcome_only_reward(environments, **_) -> list[float | None]:
    """Each rollout's last non-null reward, None when no tool call returned one."""
    return [env.reward for env in environments]


class OpenRewardSpec:
    """Wires an ORS environment into `GRPOTrainer(train_dataset=spec.train_dataset, environment_factory=
    spec.environment_factory, reward_funcs=spec.reward_funcs)`.

    `target`: a catalog name or a server URL (containing '://'). `num_tasks` (the first n) or `indices` select
    tasks of `split`. `api_key` overrides OPENREWARD_API_KEY (catalog only; it is also forwarded as the sessions'
    `api_key` secret unless `secrets` is given). `env_name`: the environment's name on the server.
    `include_metadata`: the tasks' spec fields as columns. `discover_task_tools`: open a short session per probed
    task (`task_tools_discovery_index`, else every index of `indices`, else task 0) to bind task-specific tools
    too, keeping the first schema of each name; the shared tools only when off or when every probe fails.
    """

    def __init__(
        self,
        target: str,
        *,
        num_tasks: int | None = None,
        split: str = "train",
        indices: list[int] | None = None,
        api_key: str | None = None,
        secrets: dict[str, str] | None = None,
        env_name: str | None = None,
        include_metadata: bool = True,
        discover_task_tools: bool = True,
        task_tools_discovery_index: int | None = None,
    ):
        if num_tasks is not None and indices is not None:
            raise ConfigError("OpenRewardSpec takes num_tasks (the first n tasks) or indices (chosen tasks), not both.")
        self.target, self.is_url = target, "://" in target
        self.num_tasks, self.split, self.indices = num_tasks, split, indices
        self.api_key, self.secrets, self.env_name = api_key, secrets, env_name
        self.include_metadata, self.discover_task_tools = include_metadata, discover_task_tools
        self.task_tools_discovery_index = task_tools_discovery_index

    @cached_property
    def client(self):
        openreward = import_openreward()
        kwargs: dict[str, Any] = {}
        key = self.api_key or (None if self.is_url else os.environ.get("OPENREWARD_API_KEY"))
        if key:
            kwargs["api_key"] = key
        if self.is_url:
            kwargs["base_url"] = self.target
        return openreward.OpenReward(**kwargs)

    @cached_property
    def environment(self):
        """The SDK's handle of the environment (a server URL serves one environment: any name reaches it)."""
        return self.client.environments.get((self.env_name or "env") if self.is_url else self.target)

    def session_secrets(self) -> dict[str, str] | None:
        if self.secrets is not None or self.is_url:
            return self.secrets
        key = self.api_key or os.environ.get("OPENREWARD_API_KEY")
        return {"api_key": key} if key else None

    @cached_property
    def train_dataset(self):
        from datasets import Dataset

        env = self.environment
        if self.indices is not None or self.num_tasks is not None:
            indices = (
                list(self.indices)
                if self.indices is not None
                else list(range(min(self.num_tasks, env.num_tasks(self.split))))
            )
            specs = [env.get_task(self.split, i) for i in indices]
        else:
            try:
                specs = list(env.list_tasks(self.split))
            except Exception:  # noqa: BLE001 - servers without a listing route are read task by task
                specs = [env.get_task(self.split, i) for i in range(env.num_tasks(self.split))]
            indices = list(range(len(specs)))
        specs = [s if isinstance(s, dict) else s.task_spec for s in specs]
        rows: dict[str, list] = {"prompt": [[{"role": "user", "content": ""}] for _ in indices], "task_index": indices}
        if self.include_metadata:
            keys = sorted({k for s in specs if isinstance(s, dict) for k in s} - set(rows))
            for key in keys:
                rows[key] = [s.get(key) if isinstance(s, dict) else None for s in specs]
        return Dataset.from_dict(rows)

    def tool_specs(self) -> list[Any]:
        """The tools every rollout is given (see the class's `discover_task_tools`)."""
        env = self.environment
        shared = list(env.list_tools())
        if not self.discover_task_tools:
            return shared
        try:
            count = env.num_tasks(self.split)
        except Exception as error:  # noqa: BLE001
            logger.warning("OpenRewardSpec: num_tasks failed (%s); binding the shared tools only.", error)
            return shared
        if self.task_tools_discovery_index is not None:
            probes = [self.task_tools_discovery_index]
        else:
            probes = sorted(set(self.indices)) if self.indices is not None else [0]
        probes = [i for i in probes if 0 <= i < count]
        merged: dict[str, Any] = {}
        probed = False
        for index in probes:
            try:
                with env.session(split=self.split, index=index, secrets=self.session_secrets()) as session:
                    specs = list(session.list_tools())
            except Exception as error:  # noqa: BLE001 - a failed probe falls back to what other probes found
                logger.warning("OpenRewardSpec: tool discovery on task %d failed (%s).", index, error)
                continue
            probed = True
            for spec in specs:
                name = _spec_dict(spec)["name"]
                if name in merged and _spec_dict(merged[name]) != _spec_dict(spec):
                    logger.warning("OpenRewardSpec: tool %r differs between tasks; the first schema is kept.", name)
                merged.setdefault(name, spec)
        if not probed:
            logger.warning("OpenRewardSpec: no task could be probed for its tools; binding the shared tools only.")
            return shared
        return list(merged.values())

    @cached_property
    def environment_factory(self) -> Callable[[], OpenRewardEnvironment]:
        """A new environment per call, of a subclass made for this spec carrying the server's tools as methods."""
        methods = {}
        for spec in self.tool_specs():
            method = tool_method(spec)
            if method is not None and method.__name__ in TAKEN_NAMES:
                logger.warning("OpenReward tool %r is skipped: the environment uses that name itself.", method.__name__)
            elif method is not None:
                methods[method.__name__] = method
        cls = type(f"OpenRewardEnvironment_{id(self):x}", (OpenRewardEnvironment,), methods)
        return partial(cls, environment=self.environment, split=self.split, secrets=self.session_secrets())

    @property
    def reward_funcs(self) -> Callable[..., list[float | None]]:
        return outcome_only_reward


__all__ = ["OpenRewardEnvironment", "OpenRewardSpec", "import_openreward", "outcome_only_reward", "tool_method"]
