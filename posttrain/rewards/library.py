"""Ready-made reward functions.

Every reward follows one protocol, and is called with keyword arguments:
`f(prompts=..., completions=..., **columns) -> list[float | None]`. A completion is a string (standard data) or a
list of {"role", "content"} messages (conversational data; the text is the last message's content). The other
keyword arguments are the dataset columns by name (e.g. `solution`), `completion_ids` and `trainer_state`; each
function takes the ones it needs and ignores the rest. None means "does not apply to this sample".
"""

from __future__ import annotations

import ast
import json
import os
import re
import secrets
import select
import subprocess
import sys
import threading
from collections.abc import Callable, Sequence
from typing import Any

from posttrain.errors import ConfigError, DataError
from posttrain.rewards.sandbox import SANDBOXES, check_sandbox, run_many

Completion = str | list[dict[str, Any]]
RewardFunction = Callable[..., list[float | None]]


def completion_text(completion: Completion) -> str:
    """The generated text: the string itself, or the content of the last message of a conversational one."""
    if isinstance(completion, str):
        return completion
    if isinstance(completion, list) and completion and isinstance(completion[-1], dict):
        content = completion[-1].get("content")
        if isinstance(content, str):
            return content
    raise DataError(
        f"a completion must be a string or a list of {{'role', 'content'}} messages whose last message has "
        f"string content, got {completion!r:.200}; check the prompt format of the dataset."
    )


def _texts(completions: Sequence[Completion]) -> list[str]:
    return [completion_text(completion) for completion in completions]


# Fenced blocks are matched from the start of the text, so each closing fence pairs with its own opening one.
_FENCED_BLOCK = re.compile(r"```([\w+-]*)[ \t]*\n(.*?)```", re.DOTALL)


def _last_fenced_block(text: str, languages: set[str]) -> str | None:
    """The content of the last ``` fenced block tagged with one of `languages` ("" = untagged), or None."""
    blocks = [body for tag, body in _FENCED_BLOCK.findall(text) if tag.lower() in languages]
    return blocks[-1] if blocks else None


def _column(reward: str, name: str, values: Sequence[Any] | None, count: int) -> Sequence[Any]:
    """The dataset column `name`, checked to hold one value per completion."""
    if values is None:
        raise DataError(f"{reward} needs a '{name}' dataset column; add it or remove {reward} from the rewards.")
    if len(values) != count:
        raise DataError(
            f"{reward}: column '{name}' has {len(values)} values for {count} completions; "
            f"pass one value per completion."
        )
    return values


# ---------------------------------------------------------------------------------------------------------------
# Math answers (math-verify)
# ---------------------------------------------------------------------------------------------------------------

# Seconds math-verify may spend on one parse or one comparison (it only takes whole seconds). Worst inputs
# (e.g. $10^{10^{10}}$) would otherwise never finish.
_MATH_TIMEOUT_S = 3
# A bare gold answer with LaTeX markup but no math delimiters (`\frac{1}{2}`, `1 + x^2`) needs $...$ around
# it: math-verify would otherwise read nothing, or only its first number.
_LATEX_MARKUP = re.compile(r"[\\^{]")
_MATH_DELIMITERS = re.compile(r"\$|\\\(|\\\[")


def _math_verify() -> tuple[Callable[..., Any], Callable[..., Any]]:
    try:
        from math_verify import parse, verify
    except ImportError as error:
        raise ImportError("math rewards need math-verify: pip install 'posttrain[math]'") from error
    return parse, verify


def _score_math(answer: str | None, gold: str, timeout_s: int) -> float | None:
    """Compare in this thread, which must be the main one: math-verify's timeouts use SIGALRM.

    `answer` None means the completion has no answer at all (0.0); None is returned when the gold has no
    parsable answer."""
    parse, verify = _math_verify()
    if _LATEX_MARKUP.search(gold) and not _MATH_DELIMITERS.search(gold):
        gold = f"${gold}$"
    gold_parsed = parse(gold, parsing_timeout=timeout_s)
    if not gold_parsed:
        return None
    if answer is None:
        return 0.0
    return float(verify(gold_parsed, parse(answer, parsing_timeout=timeout_s), timeout_seconds=timeout_s))


def _serve_math_requests() -> None:
    """Body of the math worker process: one JSON `[answer, gold, timeout_s]` per stdin line, one score per line."""
    _math_verify()  # import before announcing readiness, so the first request is not charged for it
    print("ready", flush=True)
    for line in sys.stdin:
        print(json.dumps(_score_math(*json.loads(line))), flush=True)


class _MathWorker:
    """A child process that scores math answers in its own main thread, for rewards called from other threads.

    SIGALRM can only be used in the main thread, and a helper thread cannot be stopped while sympy holds the
    GIL in a long big-integer loop, so a separate process is the one reliable guard. A worker that does not
    answer in time is killed (the sample scores 0.0) and a new one starts with the next request.
    """

    _STARTUP_TIMEOUT_S = 120.0

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._process: subprocess.Popen[str] | None = None

    def score(self, answer: str | None, gold: str) -> float | None:
        with self._lock:
            if self._process is None or self._process.poll() is not None:
                self._process = self._start()
            process = self._process
            assert process.stdin is not None and process.stdout is not None
            process.stdin.write(json.dumps([answer, gold, _MATH_TIMEOUT_S]) + "\n")
            process.stdin.flush()
            # Parsing gold and answer plus the comparison: three math-verify timeouts, and a margin.
            line = self._read_line(process, 3 * _MATH_TIMEOUT_S + 2.0)
            if line is None:
                process.kill()
                process.wait()
                self._process = None
                return 0.0
            return json.loads(line)

    def _start(self) -> subprocess.Popen[str]:
        process = subprocess.Popen(
            [sys.executable, "-c", "from posttrain.rewards.library import _serve_math_requests as s; s()"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
            env={**os.environ, "PYTHONPATH": os.pathsep.join(path for path in sys.path if path)},
        )
        if self._read_line(process, self._STARTUP_TIMEOUT_S) != "ready\n":
            process.kill()
            process.wait()
            raise RuntimeError("the math-verify worker process did not start; check that math-verify imports.")
        return process

    @staticmethod
    def _read_line(process: subprocess.Popen[str], timeout_s: float) -> str | None:
        """The next line from the worker, or None when it does not come in time or the worker died."""
        assert process.stdout is not None
        ready, _, _ = select.select([process.stdout], [], [], timeout_s)
        return (process.stdout.readline() or None) if ready else None


_MATH_WORKER = _MathWorker()


def _math_score(answer: str | None, gold: Any) -> float | None:
    if gold is None:
        return None
    if threading.current_thread() is threading.main_thread():
        return _score_math(answer, str(gold), _MATH_TIMEOUT_S)
    return _MATH_WORKER.score(answer, str(gold))


def accuracy_reward(
    completions: Sequence[Completion], solution: Sequence[Any] | None = None, **kwargs: Any
) -> list[float | None]:
    """1.0 when the completion's final answer equals the gold `solution` column mathematically, else 0.0.

    Both sides go through math-verify: a \\boxed{} answer wins, otherwise the last number or expression counts,
    and equivalent forms match (1/2, 0.5, \\frac{1}{2}). None when the gold solution has no parsable answer."""
    solution = _column("accuracy_reward", "solution", solution, len(completions))
    return [_math_score(text, gold) for text, gold in zip(_texts(completions), solution)]


def reasoning_accuracy_reward(
    completions: Sequence[Completion],
    solution: Sequence[Any] | None = None,
    reasoning_delimiters: Sequence[str] | None = None,
    **kwargs: Any,
) -> list[float | None]:
    """Like accuracy_reward, but only the text after the last reasoning delimiter (any of `reasoning_delimiters`,
    default `</think>`) is the answer, so numbers in the reasoning do not count; 0.0 when no delimiter closes the
    reasoning. Range {0.0, 1.0}, None for unparsable gold."""
    solution = _column("reasoning_accuracy_reward", "solution", solution, len(completions))
    delimiters = list(reasoning_delimiters) if reasoning_delimiters else ["</think>"]
    answers = [_after_last(text, delimiters) for text in _texts(completions)]
    return [_math_score(answer, gold) for answer, gold in zip(answers, solution)]


def _after_last(text: str, delimiters: list[str]) -> str | None:
    """The text after the last occurrence of any delimiter, or None if none occurs."""
    ends = [(text.rfind(d), d) for d in delimiters if d and d in text]
    if not ends:
        return None
    position, delimiter = max(ends)
    return text[position + len(delimiter) :]


# ---------------------------------------------------------------------------------------------------------------
# Format and length
# ---------------------------------------------------------------------------------------------------------------

_THINK_THEN_ANSWER = re.compile(r"\s*<think>(.*?)</think>(.*)", re.DOTALL)


def think_format_reward(completions: Sequence[Completion], **kwargs: Any) -> list[float | None]:
    """1.0 when the completion is exactly one `<think>...</think>` block at the start followed by a non-empty
    answer without further think tags, else 0.0."""
    return [float(_is_think_then_answer(text)) for text in _texts(completions)]


def _is_think_then_answer(text: str) -> bool:
    match = _THINK_THEN_ANSWER.fullmatch(text)
    if match is None:
        return False
    thought, answer = match.groups()
    return "<think>" not in thought + answer and "</think>" not in answer and bool(answer.strip())


# ---------------------------------------------------------------------------------------------------------------
# JSON
# ---------------------------------------------------------------------------------------------------------------


def _json_payload(text: str) -> Any:
    """The JSON value of the last ```json (or bare ```) fenced block, or of the whole text; ValueError if none."""
    block = _last_fenced_block(text, {"json", ""})
    return json.loads(text if block is None else block)


def json_reward(completions: Sequence[Completion], **kwargs: Any) -> list[float | None]:
    """1.0 when the completion (or its last ```json fenced block) is valid JSON, else 0.0."""
    return [_json_schema_score(text, None) for text in _texts(completions)]


def _json_validator(schema: dict[str, Any] | bool) -> Any:
    """A jsonschema validator for the schema's own draft; jsonschema's SchemaError if the schema is invalid."""
    try:
        from jsonschema.validators import validator_for
    except ImportError as error:
        raise ImportError("JSON schema rewards need jsonschema: pip install jsonschema") from error
    validator_class = validator_for(schema)
    validator_class.check_schema(schema)
    return validator_class(schema)


def _json_schema_score(text: str, validator: Any | None) -> float:
    """1.0 when the text holds JSON (valid under `validator`, when given), else 0.0."""
    try:
        value = _json_payload(text)
    except ValueError:
        return 0.0
    return float(validator is None or validator.is_valid(value))


def get_json_schema_reward(schema: dict[str, Any] | bool) -> RewardFunction:
    """Reward 1.0 for completions whose JSON (see json_reward) validates against one fixed JSON schema, else 0.0."""
    try:
        validator = _json_validator(schema)
    except Exception as error:  # jsonschema.SchemaError, or a schema of the wrong type
        raise ConfigError(f"the JSON schema for get_json_schema_reward is invalid: {error}") from error

    def json_schema_reward(completions: Sequence[Completion], **kwargs: Any) -> list[float | None]:
        return [_json_schema_score(text, validator) for text in _texts(completions)]

    return json_schema_reward


def json_schema_reward(
    completions: Sequence[Completion], schema: Sequence[Any] | None = None, **kwargs: Any
) -> list[float | None]:
    """1.0 when the completion's JSON validates against its row's `schema` column (a dict or a JSON string),
    else 0.0; None for rows without a schema."""
    schemas = _column("json_schema_reward", "schema", schema, len(completions))
    scores: list[float | None] = []
    for row, (text, row_schema) in enumerate(zip(_texts(completions), schemas)):
        if row_schema is None:
            scores.append(None)
            continue
        try:
            validator = _json_validator(json.loads(row_schema) if isinstance(row_schema, str) else row_schema)
        except Exception as error:  # bad JSON text, jsonschema.SchemaError, or a schema of the wrong type
            raise DataError(
                f"json_schema_reward: column 'schema', row {row} is not a valid JSON schema: {error}"
            ) from error
        scores.append(_json_schema_score(text, validator))
    return scores


# ---------------------------------------------------------------------------------------------------------------
# Code execution
# ---------------------------------------------------------------------------------------------------------------

# The harness the reward runs in the sandbox. stdin holds one JSON line {"solution", "tests"} and then the run's
# secret marker. The solution runs once (not as __main__, so an `if __name__ == "__main__":` block that may wait
# for input is skipped); each test then runs in its namespace, and a passing test writes "<marker> <index>".
# Reward hacking it closes: the marker is never printed or kept where the solution can look it up (no global, no
# caller frame, not in the source), so printing a success line counts for nothing; exiting early (sys.exit,
# os._exit, exit()) or raising SystemExit/KeyboardInterrupt in a test only loses the tests not yet run; the harness
# uses the functions it captured before the solution ran, so patching builtins, os or sys does not change how it
# reports; trace and profile hooks are removed before every test, so they cannot skip an assert. Forging a result
# still takes code that deliberately searches the process for the marker (gc, /proc/self/fd, ctypes).
_HARNESS = r"""
def _judge():
    import json, os, sys
    read, write, exit_now, settrace, setprofile = os.read, os.write, os._exit, sys.settrace, sys.setprofile
    run, build, Error, size = exec, compile, BaseException, len
    line = b""
    while not line.endswith(b"\n"):
        chunk = read(0, 1)
        if not chunk:
            exit_now(3)
        line += chunk
    payload = json.loads(line)
    solution, tests, marker_size = payload["solution"], payload["tests"], payload["marker_size"]
    del line, payload
    hidden = os.dup(0)  # one copy of the marker per test waits in the pipe; the solution gets an empty stdin
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    namespace = {"__name__": "solution"}
    try:
        run(build(solution, "<solution>", "exec"), namespace)
    except Error:
        write(2, b"the solution failed to run\n")
        exit_now(1)
    index, count = 0, size(tests)
    while index < count:
        settrace(None)
        setprofile(None)
        try:
            run(build(tests[index], "<test %d>" % index, "exec"), namespace)
        except Error:
            write(2, b"test %d failed\n" % index)
        else:
            write(1, read(hidden, marker_size) + b" %d\n" % index)
        index += 1
    exit_now(0)


_judge()
"""


def extract_code(text: str) -> str:
    """The last ```python (or ```py, or bare ```) fenced block of a completion, else the whole completion."""
    block = _last_fenced_block(text, {"python", "python3", "py", ""})
    return text if block is None else block


def _unit_tests(tests: str | Sequence[str], column: str, row: int) -> list[str]:
    """One snippet per test. A list holds one test per element; a string is split into one test per top-level
    `assert` (with the statements before it); a string without top-level asserts (a `check(f)` call) is one test."""
    if isinstance(tests, str):
        try:
            statements = ast.parse(tests).body
        except SyntaxError as error:
            raise DataError(
                f"code_execution_reward: column '{column}', row {row} is not valid Python: {error}"
            ) from error
        chunks, pending = [], []
        for statement in statements:
            pending.append(ast.unparse(statement))
            if isinstance(statement, ast.Assert):
                chunks.append("\n".join(pending))
                pending = []
        if pending and chunks:  # statements after the last assert belong to it
            chunks[-1] += "\n" + "\n".join(pending)
        elif pending:  # no top-level assert: the whole string is one test
            chunks.append("\n".join(pending))
        return chunks
    if isinstance(tests, Sequence) and all(isinstance(test, str) for test in tests):
        return list(tests)
    raise DataError(
        f"code_execution_reward: column '{column}', row {row} must be a list of assert statements or one string "
        f"of them, got {type(tests).__name__}."
    )


def get_code_execution_reward(
    *, timeout_s: float = 5.0, memory_mb: int = 512, max_workers: int = 2, sandbox: str = "bubblewrap"
) -> RewardFunction:
    """A code_execution_reward with its own sandbox limits (per sample), number of parallel processes and sandbox
    ("bubblewrap", the isolated default, or the weaker "process" fallback; see posttrain.rewards.sandbox)."""
    if sandbox not in SANDBOXES:
        raise ConfigError(f"sandbox={sandbox!r} is not a sandbox; choose 'bubblewrap' (the default) or 'process'.")

    def code_execution_reward(
        completions: Sequence[Completion],
        test_cases: Sequence[Any] | None = None,
        tests: Sequence[Any] | None = None,
        **kwargs: Any,
    ) -> list[float | None]:
        """Pass rate (passed / total, in [0, 1]) of the sample's unit tests (column `test_cases` or `tests`:
        assert statements as a list of strings or one string) on the completion's code (its last ```python
        block, else all of it), run in the sandbox; None for rows without tests."""
        if test_cases is None and tests is None:
            raise DataError(
                "code_execution_reward needs a 'test_cases' (or 'tests') dataset column of assert statements; "
                "add it or remove code_execution_reward from the rewards."
            )
        column, values = ("test_cases", test_cases) if test_cases is not None else ("tests", tests)
        rows = _column("code_execution_reward", column, values, len(completions))
        check_sandbox(sandbox)  # refuses before running anything when bubblewrap is missing and not opted out
        marker = secrets.token_hex(16).encode()
        todo: dict[int, list[str]] = {}
        jobs: list[str] = []
        for row, (text, row_tests) in enumerate(zip(_texts(completions), rows)):
            unit_tests = [] if row_tests is None else _unit_tests(row_tests, column, row)
            if unit_tests:
                todo[row] = unit_tests
                payload = {"solution": extract_code(text), "tests": unit_tests, "marker_size": len(marker)}
                jobs.append(json.dumps(payload) + "\n" + marker.decode() * len(unit_tests))
        results = run_many(
            [_HARNESS] * len(jobs),
            stdins=jobs,
            max_workers=max_workers,
            timeout_s=timeout_s,
            memory_mb=memory_mb,
            sandbox=sandbox,
        )
        scores: list[float | None] = [None] * len(completions)
        prefix = marker.decode() + " "
        for (row, unit_tests), result in zip(todo.items(), results):
            passed = {line[len(prefix) :] for line in result.stdout.splitlines() if line.startswith(prefix)}
            scores[row] = len(passed & {str(index) for index in range(len(unit_tests))}) / len(unit_tests)
        return scores

    code_execution_reward.sandbox = sandbox  # read by RewardScorer to check the sandbox before training
    return code_execution_reward


code_execution_reward = get_code_execution_reward()
