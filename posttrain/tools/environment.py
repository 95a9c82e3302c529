"""TRL's ``environment_factory=`` contract: one environment per rollout, its public methods as the tools.

An environment is any object with a ``reset(**row)`` method. At the start of a rollout it is reset with the
dataset row (every column; in the dict form without the ``environment`` column); a returned string is appended to
the last message of the prompt (no separator), None leaves the prompt alone. Its public methods (defined on the
class, not starting with ``_``, other than ``reset`` and ``get_reward``) are the rollout's tools, bound to that
instance, so state stays private to the rollout. A ``get_reward()`` method (sync or async) makes the environment a
reward source: it is read once per finished rollout, weight 1, named after the class.

TRL has no "done" signal: an episode ends when the model answers without a tool call, at
`max_tool_calling_iterations`, or at the length limit; a game that is over says so through its tools' results.
`EnvironmentPool(done_attribute="done")` lets an engine also stop once ``env.done`` is true (posttrain's option,
off by default, so a TRL environment behaves as in TRL).

The factory can be one callable (every row uses it) or a dict ``{name: factory}``, where each row's
``environment`` column picks one and only that environment's tools are shown in its prompt. Instances are built
once and reused across batches (reset each time); the pool grows only when a batch needs more at once.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from posttrain.errors import ConfigError, DataError
from posttrain.tools.schema import tool_schema, tool_schemas

RESERVED = ("reset", "get_reward")


def environment_methods(environment: Any) -> list[Callable]:
    """The environment's tools: its class's public functions (properties are not evaluated), bound to it."""
    return [
        getattr(environment, name)
        for name, _ in inspect.getmembers(type(environment), inspect.isfunction)
        if not name.startswith("_") and name not in RESERVED
    ]


@dataclass
class EnvironmentSlot:
    """One rollout's environment, the tools bound to it and what `reset` returned."""

    name: Any
    environment: Any
    tools: list[Callable]
    observation: Any = None


class EnvironmentPool:
    """Builds and reuses environments, one per rollout, for a single factory or TRL's dict of factories.

    `standalone_tools` (the trainer's ``tools=``) are offered next to every environment's methods.
    """

    def __init__(
        self,
        environment_factory: Callable[[], Any] | Mapping[Any, Callable[[], Any]],
        standalone_tools: Sequence[Callable] = (),
        done_attribute: str | None = None,
    ):
        self.multi = isinstance(environment_factory, Mapping)
        factories = dict(environment_factory) if self.multi else {None: environment_factory}
        if not factories:
            raise ConfigError(
                "environment_factory={} names no environment; give a callable, or a dict "
                "{name: callable} with at least one entry."
            )
        self.factories = factories
        # row columns that choose or stand in for something and are not passed to reset()
        self.control_columns: set[str] = {"environment"} if self.multi else set()
        self.standalone_tools = list(standalone_tools)
        self.done_attribute = done_attribute
        self.pool: dict[Any, list[Any]] = {}
        self.tool_schemas: dict[Any, list[dict]] = {}
        self.reward_classes: list[type] = []
        for name, factory in factories.items():
            if not callable(factory):
                raise ConfigError(
                    f"environment_factory[{name!r}] is a {type(factory).__name__}, not a callable "
                    "that returns a new environment."
                )
            instance = self._build(name)
            self.pool[name] = [instance]
            methods = environment_methods(instance)
            label = type(instance).__qualname__
            for method in methods:
                try:
                    tool_schema(method)
                except ConfigError as error:
                    raise ConfigError(
                        f"Environment {label}: public method {method.__name__} is offered to the model "
                        f"as a tool but {error} (Rename it with a leading _ if it is not a tool.)"
                    ) from error
            self.tool_schemas[name] = tool_schemas(self.standalone_tools + methods)
            if callable(getattr(instance, "get_reward", None)) and type(instance) not in self.reward_classes:
                self.reward_classes.append(type(instance))

    def _build(self, name: Any) -> Any:
        instance = self.factories[name]()
        if not callable(getattr(instance, "reset", None)):
            label = "environment_factory" if name is None else f"environment_factory[{name!r}]"
            raise ConfigError(
                f"{label} returned a {type(instance).__name__} without a callable `reset` method; every "
                "environment needs `reset(self, **kwargs) -> str | None`, called with the dataset row."
            )
        return instance

    @property
    def tools(self) -> list[Callable]:
        """Every tool any rollout may see (for async detection and TRL's `trainer.tools`), the probe instances'
        ones; an environment class named twice in a dict factory gives its methods once."""
        seen: list[Callable] = list(self.standalone_tools)
        functions = {getattr(tool, "__func__", tool) for tool in seen}
        for instances in self.pool.values():
            for method in environment_methods(instances[0]):
                if method.__func__ not in functions:
                    functions.add(method.__func__)
                    seen.append(method)
        return seen

    def name_of(self, row: Mapping[str, Any]) -> Any:
        if not self.multi:
            return None
        if "environment" not in row:
            raise DataError(
                "With a dict environment_factory every row needs an `environment` column naming its "
                f"environment (one of {list(self.factories)}); this row has {sorted(row)}."
            )
        if row["environment"] not in self.factories:
            raise DataError(
                f"Row has environment={row['environment']!r}, which is not among the environments passed to "
                f"environment_factory; expected one of {list(self.factories)}."
            )
        return row["environment"]

    def start(self, rows: Sequence[Mapping[str, Any]]) -> list[EnvironmentSlot]:
        """One reset environment per row (in order), reusing built ones; rows may repeat (one per generation)."""
        names = [self.name_of(row) for row in rows]
        used: dict[Any, int] = {}
        episodes = []
        for name, row in zip(names, rows):
            instances = self.pool[name]
            index = used.get(name, 0)
            if index == len(instances):
                instances.append(self._build(name))
            used[name] = index + 1
            environment = instances[index]
            kwargs = {k: v for k, v in row.items() if k not in self.control_columns}
            observation = environment.reset(**kwargs)
            episodes.append(
                EnvironmentSlot(
                    name, environment, self.standalone_tools + environment_methods(environment), observation
                )
            )
        return episodes

    def is_done(self, episode: EnvironmentSlot) -> bool:
        """True once the environment's `done_attribute` is truthy (always False without one, as in TRL)."""
        return bool(self.done_attribute and getattr(episode.environment, self.done_attribute, False))

    def reward_functions(self) -> list[tuple[str, Callable]]:
        """``(class name, reward function)`` per environment class with ``get_reward``: the function takes
        ``environments=[...]`` (and any other keyword) and gives each rollout of that exact class its
        ``get_reward()``, None (not applicable) to the others. Async ``get_reward`` gives an async function."""
        functions = []
        for cls in self.reward_classes:
            if inspect.iscoroutinefunction(cls.get_reward):

                async def reward(environments, _cls=cls, **kwargs):
                    return [await e.get_reward() if type(e) is _cls else None for e in environments]
            else:

                def reward(environments, _cls=cls, **kwargs):
                    return [e.get_reward() if type(e) is _cls else None for e in environments]

            reward.__name__ = cls.__name__
            functions.append((cls.__name__, reward))
        return functions


def prompt_with_observation(prompt: list[dict] | None, observation: Any) -> list[dict]:
    """The prompt of a rollout after `reset`: `observation` appended to the last message's content (a new list;
    the row is left untouched). A row without a prompt starts from one empty user message, as in TRL."""
    prompt = list(prompt) if prompt else [{"role": "user", "content": ""}]
    if observation is None:
        return prompt
    content = prompt[-1]["content"]
    if isinstance(observation, list) and isinstance(content, str):
        content = [{"type": "text", "text": content}]
    if isinstance(observation, str) and isinstance(content, list):
        observation = [{"type": "text", "text": observation}]
    return prompt[:-1] + [{**prompt[-1], "content": content + observation}]
