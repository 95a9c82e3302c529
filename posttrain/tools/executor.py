"""Running the model's tool calls without ever crashing the rollout.

`ToolExecutor(tools).run(turn)` runs one assistant turn's calls in the order the model wrote them and returns one
`ToolResult` per call attempt: the tool message the model reads next (``{"role": "tool", "name", "content"}``), a
status (``ok`` / ``failed`` / ``timed_out`` / ``parse_error``), the seconds it took and the error text. Every way a
call can go wrong ends as text the model sees: an unreadable call, an unknown tool, missing / unexpected /
wrongly typed arguments, an exception, a timeout.

Sync tools run one after another (environment methods change state; order matters), each in a daemon thread so
a timeout can return control (Python cannot stop the thread: a timed-out call may still finish in the background).
Async tools of one turn run concurrently on a private event loop, each under `asyncio.wait_for`.

Results become text: a str as is, a dict or list as JSON, anything else as its repr; a list of content blocks
(``[{"type": "text"|"image", ...}]``) is kept as multimodal content. Text longer than `max_result_chars` is cut, with
a marker saying how much was cut.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from posttrain.errors import ConfigError
from posttrain.tools.parsers import ParsedTurn, ParseError, ToolCall, json_types
from posttrain.tools.schema import describe_arguments, tool_schemas

OK, FAILED, TIMED_OUT, PARSE_ERROR = "ok", "failed", "timed_out", "parse_error"
TRUNCATION_MARKER = "\n[... {n} more characters cut]"


@dataclass
class ToolResult:
    """The outcome of one call attempt, and the tool message that carries it back to the model."""

    name: str
    status: str
    content: str | list
    seconds: float = 0.0
    error: str | None = None
    arguments: dict = field(default_factory=dict)

    @property
    def message(self) -> dict:
        return {"role": "tool", "name": self.name, "content": self.content}

    @property
    def counts_as_call(self) -> bool:
        """TRL counts every call with a name (unknown tools included) in ``tools/call_frequency``; an unreadable
        call (invalid or unterminated JSON) is not a call there (TRL reads it as plain text)."""
        return self.status != PARSE_ERROR

    @property
    def failed(self) -> bool:
        return self.status in (FAILED, TIMED_OUT)


@dataclass
class ToolStats:
    """Counts for TRL's metrics over a batch; add them up across turns, episodes and processes."""

    calls: int = 0
    failures: int = 0
    parse_errors: int = 0

    def __add__(self, other: ToolStats) -> ToolStats:
        return ToolStats(
            self.calls + other.calls, self.failures + other.failures, self.parse_errors + other.parse_errors
        )

    @classmethod
    def of(cls, results: Sequence[ToolResult]) -> ToolStats:
        return cls(
            sum(r.counts_as_call for r in results),
            sum(r.failed and r.counts_as_call for r in results),
            sum(r.status == PARSE_ERROR for r in results),
        )

    def metrics(self, num_rollouts: int) -> dict[str, float]:
        """TRL's ``tools/call_frequency`` (calls per rollout) and ``tools/failure_frequency`` (failed / calls, 0
        without calls), plus posttrain's ``tools/parse_error_frequency`` (unreadable calls per rollout)."""
        rollouts = max(num_rollouts, 1)
        return {
            "tools/call_frequency": self.calls / rollouts,
            "tools/failure_frequency": self.failures / self.calls if self.calls else 0.0,
            "tools/parse_error_frequency": self.parse_errors / rollouts,
        }


def error_text(message: str) -> str:
    """An error as the model reads it: ``{"error": "..."}``."""
    return json.dumps({"error": message}, ensure_ascii=False)


def _is_content_blocks(value: Any) -> bool:
    return (
        isinstance(value, list)
        and bool(value)
        and all(isinstance(v, dict) and v.get("type") in ("text", "image") for v in value)
    )


def result_text(value: Any, max_chars: int | None = None) -> str | list:
    """What a tool returned, as the content of the tool message."""
    if _is_content_blocks(value):
        return value
    if isinstance(value, str):
        text = value
    elif isinstance(value, (dict, list, tuple)):
        try:
            text = json.dumps(value, ensure_ascii=False)
        except (TypeError, ValueError):
            text = repr(value)
    else:
        text = repr(value)
    if max_chars is not None and len(text) > max_chars:
        text = text[:max_chars] + TRUNCATION_MARKER.format(n=len(text) - max_chars)
    return text


_JSON_TYPES = {
    "string": (str,),
    "integer": (int,),
    "number": (int, float),
    "boolean": (bool,),
    "array": (list,),
    "object": (dict,),
    "null": (type(None),),
}


def _type_ok(value: Any, schema: dict) -> bool:
    allowed = json_types(schema)
    if not allowed:
        return True
    if isinstance(value, bool) and "boolean" not in allowed:
        return False  # JSON true is not a number
    if not any(isinstance(value, _JSON_TYPES.get(kind, object)) for kind in allowed):
        return False
    return "enum" not in schema or value in schema["enum"]


def check_arguments(function: Callable, schema: dict, arguments: Any) -> str | None:
    """Why these arguments cannot be passed (missing, unexpected, wrong JSON type), or None if they can."""
    if not isinstance(arguments, dict):
        return f"arguments must be a JSON object, got {type(arguments).__name__}"
    try:
        inspect.signature(function).bind(**arguments)
    except TypeError as error:
        return f"bad arguments: {error}"
    properties = describe_arguments(schema)
    wrong = [
        f"{key!r} must be {properties[key].get('type')}"
        + (f" in {properties[key]['enum']}" if "enum" in properties[key] else "")
        for key, value in arguments.items()
        if key in properties and not _type_ok(value, properties[key])
    ]
    return f"bad arguments: {'; '.join(wrong)}" if wrong else None


class _Loop:
    """A private event loop on a daemon thread, shared by the executors of a process."""

    _loop: asyncio.AbstractEventLoop | None = None
    _lock = threading.Lock()

    @classmethod
    def get(cls) -> asyncio.AbstractEventLoop:
        with cls._lock:
            if cls._loop is None or cls._loop.is_closed():
                cls._loop = asyncio.new_event_loop()
                threading.Thread(target=cls._loop.run_forever, name="posttrain-tools", daemon=True).start()
            return cls._loop


class ToolExecutor:
    """Runs calls against a fixed set of tools (functions, async functions, bound methods).

    `timeout`: seconds per call (None: no limit). `max_result_chars`: cut longer results (None: keep all).
    """

    def __init__(self, tools: Sequence[Callable], timeout: float | None = 30.0, max_result_chars: int | None = None):
        if timeout is not None and timeout <= 0:
            raise ConfigError(f"tool timeout={timeout}: must be a positive number of seconds, or None for no limit.")
        if max_result_chars is not None and max_result_chars < 1:
            raise ConfigError(f"max_result_chars={max_result_chars}: must be at least 1, or None to keep results.")
        schemas = tool_schemas(tools)
        self.tools = {s["function"]["name"]: tool for s, tool in zip(schemas, tools)}
        self.schemas = {s["function"]["name"]: s for s in schemas}
        self.timeout = timeout
        self.max_result_chars = max_result_chars

    def run(self, turn: ParsedTurn | Sequence[ToolCall | ParseError]) -> list[ToolResult]:
        """One result per call attempt of the turn, in the model's order."""
        attempts = list(turn.attempts if isinstance(turn, ParsedTurn) else turn)
        results: list[ToolResult | None] = [None] * len(attempts)
        pending: list[tuple[int, ToolCall]] = []
        for index, attempt in enumerate(attempts):
            if isinstance(attempt, ParseError):
                status = FAILED if attempt.kind == "unknown_tool" else PARSE_ERROR
                results[index] = ToolResult(
                    attempt.name or "unknown", status, error_text(attempt.message), error=attempt.message
                )
                continue
            problem = self._problem(attempt)
            if problem is not None:
                results[index] = ToolResult(
                    attempt.name, FAILED, error_text(problem), error=problem, arguments=attempt.arguments
                )
            elif inspect.iscoroutinefunction(self.tools[attempt.name]):
                pending.append((index, attempt))
            else:
                results[index] = self._run_sync(attempt)
        if pending:
            future = asyncio.run_coroutine_threadsafe(self._run_async([call for _, call in pending]), _Loop.get())
            for (index, _), result in zip(pending, future.result()):
                results[index] = result
        return results  # type: ignore[return-value]

    def _problem(self, call: ToolCall) -> str | None:
        if call.name not in self.tools:
            return f"there is no tool named {call.name!r}; available: {sorted(self.tools)}"
        return check_arguments(self.tools[call.name], self.schemas[call.name], call.arguments)

    def _finish(
        self,
        call: ToolCall,
        started: float,
        value: Any = None,
        error: BaseException | None = None,
        timed_out: bool = False,
    ) -> ToolResult:
        seconds = time.perf_counter() - started
        if timed_out:
            message = f"tool {call.name!r} did not finish within {self.timeout:g} s"
            return ToolResult(call.name, TIMED_OUT, error_text(message), seconds, message, call.arguments)
        if error is not None:
            message = f"{type(error).__name__}: {error}"
            return ToolResult(call.name, FAILED, error_text(message), seconds, message, call.arguments)
        try:
            content = result_text(value, self.max_result_chars)
        except Exception as failure:  # noqa: BLE001 - a result whose repr raises is still a tool failure
            message = f"the result could not be turned into text ({type(failure).__name__}: {failure})"
            return ToolResult(call.name, FAILED, error_text(message), seconds, message, call.arguments)
        return ToolResult(call.name, OK, content, seconds, None, call.arguments)

    def _run_sync(self, call: ToolCall) -> ToolResult:
        outcome: dict[str, Any] = {}

        def target():
            try:
                outcome["value"] = self.tools[call.name](**call.arguments)
            except BaseException as error:  # noqa: BLE001 - SystemExit in a tool must not end the run either
                outcome["error"] = error

        started = time.perf_counter()
        worker = threading.Thread(target=target, name=f"tool-{call.name}", daemon=True)
        worker.start()
        worker.join(self.timeout)
        if worker.is_alive():
            return self._finish(call, started, timed_out=True)
        if "error" not in outcome and "value" not in outcome:
            return self._finish(call, started, error=RuntimeError("the tool ended without a result"))
        return self._finish(call, started, outcome.get("value"), outcome.get("error"))

    async def _run_async(self, calls: list[ToolCall]) -> list[ToolResult]:
        async def one(call: ToolCall) -> ToolResult:
            started = time.perf_counter()
            try:
                value = await asyncio.wait_for(self.tools[call.name](**call.arguments), self.timeout)
            except TimeoutError as error:  # wait_for's, or one the tool raised itself before the limit
                expired = self.timeout is not None and time.perf_counter() - started >= self.timeout
                return self._finish(call, started, error=None if expired else error, timed_out=expired)
            except Exception as error:  # noqa: BLE001 - becomes the tool message
                return self._finish(call, started, error=error)
            return self._finish(call, started, value)

        return list(await asyncio.gather(*(one(call) for call in calls)))
