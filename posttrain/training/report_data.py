"""The numbers behind the training report: the log history read back from a run's output directory, each metric's
series of finite values, the metrics grouped as the plots draw them, and a sample of the logged completions.
"""

from __future__ import annotations

import json
import math
import numbers
import re
from pathlib import Path
from typing import Any, NamedTuple

from posttrain.errors import ConfigError, DataError

METRICS_NAME = "metrics.jsonl"
STATE_NAME = "trainer_state.json"
COMPLETIONS_NAME = "completions.jsonl"
EVAL_PREFIX = "eval_"

# Groups drawn first, in this order; every other group follows in order of first appearance.
LEADING_GROUPS = ("loss", "learning_rate", "grad_norm")

# Timing, throughput and the run-averaged train loss: facts about the run for the summary table, not curves.
RUN_STATISTICS = frozenset(
    {
        "train_runtime",
        "train_samples_per_second",
        "train_steps_per_second",
        "total_flos",
        "train_loss",
        "eval_runtime",
        "eval_samples_per_second",
        "eval_steps_per_second",
    }
)


class Series(NamedTuple):
    """One metric as plotted: the steps where it was logged with a finite value, and those values.

    ``window_start``: the step the first value's logging window began at (train metrics are averages over the
    steps since the previous log), so a metric logged once is drawn as a line over that window, not a lone dot.
    """

    steps: list[float]
    values: list[float]
    window_start: float = 0.0


def load_log_history(output_dir: str | Path) -> list[dict[str, Any]]:
    """Read the log history from OUTPUT_DIR/metrics.jsonl (written as the run logs), else from trainer_state.json,
    else from the newest checkpoint-N/.

    metrics.jsonl is there whatever the save strategy, also for an interrupted or still-running run; the
    trainer_state.json files serve runs made before it existed.
    """
    metrics_path = Path(output_dir) / METRICS_NAME
    if metrics_path.is_file():
        return _read_metrics_jsonl(metrics_path)
    state_path = _find_trainer_state(Path(output_dir))
    try:
        state = json.loads(state_path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as err:
        raise DataError(f"{state_path} is not valid JSON ({err}); it may be half-written, rerun the report.") from err
    history = state.get("log_history") if isinstance(state, dict) else None
    if not isinstance(history, list) or not all(isinstance(row, dict) for row in history):
        raise DataError(
            f"{state_path} has no 'log_history' list of dicts; pass the trainer_state.json that "
            "transformers' Trainer writes, or give write_report(log_history=...) directly."
        )
    return history


def _read_metrics_jsonl(path: Path) -> list[dict[str, Any]]:
    """One log entry per line; a half-written last line (a run killed mid-write) is skipped."""
    lines = [line for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    history = []
    for number, line in enumerate(lines, start=1):
        try:
            row = json.loads(line)
        except json.JSONDecodeError as err:
            if number == len(lines):
                break
            raise DataError(f"{path} line {number} is not valid JSON ({err}); fix or delete that line.") from err
        if not isinstance(row, dict):
            raise DataError(f"{path} line {number} is not a JSON object of logged metrics; fix or delete that line.")
        history.append(row)
    return history


def _find_trainer_state(output_dir: Path) -> Path:
    """The top-level trainer_state.json, or the one in the checkpoint with the highest step number."""
    if not output_dir.is_dir():
        raise DataError(f"Output directory {output_dir} does not exist; pass the output_dir of a training run.")
    top_level = output_dir / STATE_NAME
    if top_level.is_file():
        return top_level
    checkpoints = [
        (int(match.group(1)), path / STATE_NAME)
        for path in output_dir.iterdir()
        if (match := re.fullmatch(r"checkpoint-(\d+)", path.name)) and (path / STATE_NAME).is_file()
    ]
    if not checkpoints:
        raise DataError(
            f"No {STATE_NAME} in {output_dir} nor in any checkpoint-N/ inside it; point at a run's output_dir "
            "after at least one save (save_steps) or call trainer.save_state()."
        )
    return max(checkpoints)[1]


def as_number(value: Any) -> float | None:
    """The value as a float when it is a real number (NaN included); None for missing values, bools and text."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        return None
    return float(value)


def collect_series(log_history: list[dict[str, Any]]) -> dict[str, Series]:
    """Every numeric key except ``step``, in order of first appearance, keeping only its finite values.

    A NaN, inf or None is skipped rather than zeroed: the line then joins its neighbours, and the value never
    pretends to have been logged.
    """
    series: dict[str, Series] = {}
    last_train_step = 0.0  # where the current train logging window began
    for index, row in enumerate(log_history):
        step = as_number(row.get("step"))
        if step is None or not math.isfinite(step):
            raise DataError(
                f"log_history row {index} has no numeric 'step' ({row!r}); every row the Trainer logs carries "
                "one, so add it when building the history by hand."
            )
        is_train_row = not any(key.startswith(EVAL_PREFIX) or key in RUN_STATISTICS for key in row)
        summary = "train_runtime" in row  # the end-of-training summary, which repeats the last window's metrics
        for key, raw in row.items():
            value = as_number(raw)
            if key == "step" or value is None:
                continue
            points = series.setdefault(key, Series([], []))
            if summary and points.steps and points.steps[-1] == row["step"]:
                continue  # that window is drawn already
            if math.isfinite(value):
                if not points.steps:
                    series[key] = points = points._replace(window_start=last_train_step if is_train_row else step)
                points.steps.append(row["step"])
                points.values.append(value)
        if is_train_row:
            last_train_step = step
    return series


def _group_name(key: str) -> str:
    """``eval_x`` is drawn with its train twin ``x``; ``prefix/rest`` with the other ``prefix/*`` keys."""
    base = key.removeprefix(EVAL_PREFIX)
    return base.split("/", 1)[0] or base


def metric_groups(log_history: list[dict[str, Any]]) -> dict[str, dict[str, Series]]:
    """Group name -> {metric key -> the series drawn for it}: exactly the data that goes into the plots.

    loss (with eval_loss), learning_rate and grad_norm come first; every other numeric key except ``epoch`` and
    the run statistics is grouped by its prefix before the first ``/``, in order of first appearance.
    """
    groups: dict[str, dict[str, Series]] = {name: {} for name in LEADING_GROUPS}
    for key, points in collect_series(log_history).items():
        if key != "epoch" and key not in RUN_STATISTICS:
            groups.setdefault(_group_name(key), {})[key] = points
    return {name: lines for name, lines in groups.items() if lines}


def display_name(key: str) -> str:
    """A metric key short enough to read: a reward model's path in ``rewards/<path>/mean`` becomes its last
    component (``rewards/<name>/mean``), as TRL names reward models; other keys are unchanged."""
    prefix = EVAL_PREFIX if key.startswith(EVAL_PREFIX) else ""
    parts = [part for part in key.removeprefix(prefix).split("/") if part]
    if len(parts) > 3:
        parts = [parts[0], parts[-2], parts[-1]]
    return prefix + "/".join(parts) if parts else key


def sample_completions(path: str | Path, steps: int = 4, per_step: int = 2) -> list[dict[str, Any]]:
    """The first ``per_step`` records at up to ``steps`` logged steps spread evenly from the first to the last,
    those with a tool-calling ``transcript`` before the others.

    The file is streamed and only the kept records stay in memory, since online runs can log many of them.
    """
    if steps < 2 or per_step < 1:
        raise ConfigError(
            f"sample_completions needs steps >= 2 and per_step >= 1; got steps={steps}, per_step={per_step}."
        )
    by_step: dict[Any, list[dict[str, Any]]] = {}
    with open(path, encoding="utf-8") as file:
        for line_number, line in enumerate(file, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as err:
                raise DataError(
                    f"{path} line {line_number} is not valid JSON ({err}); fix or delete that line."
                ) from err
            if not isinstance(record, dict) or as_number(record.get("step")) is None or "completion" not in record:
                raise DataError(
                    f"{path} line {line_number} must be a JSON object with a numeric 'step' and a 'completion' "
                    f"(plus optional 'prompt' and 'reward'); got {line.strip()[:200]!r}."
                )
            kept = by_step.setdefault(record["step"], [])
            if len(kept) < per_step:
                kept.append(record)
            elif record.get("transcript"):  # tool-calling episodes are worth showing before plain completions
                plain = next((i for i, other in enumerate(kept) if not other.get("transcript")), None)
                if plain is not None:
                    kept.pop(plain)
                    kept.append(record)
    logged = sorted(by_step)
    if len(logged) > steps:
        logged = [logged[round(i * (len(logged) - 1) / (steps - 1))] for i in range(steps)]
    return [record for step in logged for record in by_step[step]]
