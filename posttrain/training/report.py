"""End-of-run report: one PNG per metric group and a self-contained report.html in the output directory.

Everything is rebuilt from the Trainer's ``log_history`` (plus the optional ``completions.jsonl`` written by
the online trainers), so the same code serves the end of training and ``posttrain report OUTPUT_DIR`` on any run:
every trainer appends each log entry to ``metrics.jsonl`` as it logs, whatever the save strategy. Each quantity gets
its own panel (its own scale); matplotlib is imported only when a plot is drawn, so importing this module stays cheap.
"""

from __future__ import annotations

import base64
import html
import json
import math
import numbers
import re
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

from posttrain.errors import ConfigError, DataError

if TYPE_CHECKING:
    from matplotlib.figure import Figure

REPORT_NAME = "report.html"
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


def _as_number(value: Any) -> float | None:
    """The value as a float when it is a real number (NaN included); None for missing values, bools and text."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        return None
    return float(value)


def _collect_series(log_history: list[dict[str, Any]]) -> dict[str, Series]:
    """Every numeric key except ``step``, in order of first appearance, keeping only its finite values.

    A NaN, inf or None is skipped rather than zeroed: the line then joins its neighbours, and the value never
    pretends to have been logged.
    """
    series: dict[str, Series] = {}
    last_train_step = 0.0  # where the current train logging window began
    for index, row in enumerate(log_history):
        step = _as_number(row.get("step"))
        if step is None or not math.isfinite(step):
            raise DataError(
                f"log_history row {index} has no numeric 'step' ({row!r}); every row the Trainer logs carries "
                "one, so add it when building the history by hand."
            )
        is_train_row = not any(key.startswith(EVAL_PREFIX) or key in RUN_STATISTICS for key in row)
        for key, raw in row.items():
            value = _as_number(raw)
            if key == "step" or value is None:
                continue
            points = series.setdefault(key, Series([], []))
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
    for key, points in _collect_series(log_history).items():
        if key != "epoch" and key not in RUN_STATISTICS:
            groups.setdefault(_group_name(key), {})[key] = points
    return {name: lines for name, lines in groups.items() if lines}


def _matplotlib() -> tuple[type, type]:
    """Import the Agg canvas without pyplot: no global backend switch, no figures left open."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as err:
        raise ImportError(
            "The training report draws its plots with matplotlib, which is not installed: pip install matplotlib"
        ) from err
    return Figure, FigureCanvasAgg


def display_name(key: str) -> str:
    """A metric key short enough to read: a reward model's path in ``rewards/<path>/mean`` becomes its last
    component (``rewards/<name>/mean``), as TRL names reward models; other keys are unchanged."""
    prefix = EVAL_PREFIX if key.startswith(EVAL_PREFIX) else ""
    parts = [part for part in key.removeprefix(prefix).split("/") if part]
    if len(parts) > 3:
        parts = [parts[0], parts[-2], parts[-1]]
    return prefix + "/".join(parts) if parts else key


def panels(lines: dict[str, Series]) -> dict[str, dict[str, Series]]:
    """Quantity -> its lines: a train metric and its ``eval_`` twin share a panel (same scale), nothing else does."""
    grouped: dict[str, dict[str, Series]] = {}
    for key, points in lines.items():
        grouped.setdefault(key.removeprefix(EVAL_PREFIX), {})[key] = points
    return grouped


def plot_group(name: str, lines: dict[str, Series]) -> Figure:
    """Draw one group, one panel per quantity with its own y scale, against the step.

    Eval lines are dashed with markers (they are sparse). A metric logged once is a line, not a lone dot: a train
    value over the logging window it averages, an eval value as a level across the panel.
    """
    figure_class, canvas_class = _matplotlib()
    quantities = panels(lines)
    columns = 1 if len(quantities) == 1 else 2
    rows = math.ceil(len(quantities) / columns)
    height = 1.2 + 2.8 * rows
    figure = figure_class(figsize=(7 if columns == 1 else 11, height), dpi=100)
    # Fixed margins: constrained layout measures every tick label and draws each figure twice (half the time).
    figure.subplots_adjust(
        left=0.09 if columns == 1 else 0.07,
        right=0.97,
        bottom=0.55 / height,
        top=1 - 0.75 / height,
        wspace=0.25,
        hspace=1.0 / rows + 0.3,
    )
    canvas_class(figure)
    for index, (quantity, quantity_lines) in enumerate(quantities.items()):
        axes = figure.add_subplot(rows, columns, index + 1)
        for key, points in quantity_lines.items():
            _draw_series(axes, key, points)
        axes.set(title="" if display_name(quantity) == name else display_name(quantity), xlabel="step")
        axes.grid(alpha=0.3)
        axes.legend(fontsize="small")
    figure.suptitle(name)
    return figure


def _draw_series(axes, key: str, points: Series) -> None:
    is_eval = key.startswith(EVAL_PREFIX)
    style = {"label": display_name(key), "linestyle": "--" if is_eval else "-", "markersize": 4}
    if len(points.steps) != 1:
        axes.plot(points.steps, points.values, marker="o" if is_eval or len(points.steps) < 20 else None, **style)
        return
    (line,) = axes.plot(points.steps, points.values, marker="o", **style)
    if is_eval or points.window_start >= points.steps[0]:
        axes.axhline(points.values[0], color=line.get_color(), linestyle=":", linewidth=1)
    else:
        axes.hlines(points.values[0], points.window_start, points.steps[0], color=line.get_color(), linewidth=1.5)


def _plot_file_name(group: str, taken: set[str]) -> str:
    """``plot_<slug>.png``, with a numeric suffix when two group names slug to the same file."""
    slug = re.sub(r"[^a-z0-9]+", "_", group.lower()).strip("_") or "metric"
    name, suffix = f"plot_{slug}.png", 2
    while name in taken:
        name, suffix = f"plot_{slug}_{suffix}.png", suffix + 1
    taken.add(name)
    return name


def save_plots(groups: dict[str, dict[str, Series]], output_dir: str | Path) -> dict[str, Path]:
    """Write one PNG per group into ``output_dir``; returns group name -> PNG path."""
    taken: set[str] = set()
    paths = {}
    for name, lines in groups.items():
        path = Path(output_dir) / _plot_file_name(name, taken)
        plot_group(name, lines).savefig(path, format="png")
        paths[name] = path
    return paths


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
            if not isinstance(record, dict) or _as_number(record.get("step")) is None or "completion" not in record:
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


def write_report(
    output_dir: str | Path, log_history: list[dict[str, Any]] | None = None, title: str | None = None
) -> Path:
    """Write the PNG plots and report.html into ``output_dir``; returns report.html's path.

    ``log_history`` defaults to the one saved in ``output_dir`` (see ``load_log_history``).
    """
    output_dir = Path(output_dir)
    if log_history is None:
        log_history = load_log_history(output_dir)
    groups = metric_groups(log_history)
    if not groups:
        raise DataError(
            f"Nothing to report for {output_dir}: the log history has {len(log_history)} row(s) and no metric to "
            "plot. Train for at least `logging_steps` steps (or lower logging_steps) before writing a report."
        )
    output_dir.mkdir(parents=True, exist_ok=True)
    plots = save_plots(groups, output_dir)
    completions_path = output_dir / COMPLETIONS_NAME
    completions = sample_completions(completions_path) if completions_path.is_file() else []
    title = title or f"Training report: {output_dir.resolve().name}"
    body = "\n".join(
        [
            f"<h1>{html.escape(title)}</h1>",
            f'<p class="meta">Output directory: {html.escape(str(output_dir.resolve()))}</p>',
            _summary_html(log_history),
            _plots_html(groups, plots),
            _completions_html(completions),
        ]
    )
    report = output_dir / REPORT_NAME
    report.write_text(_PAGE.format(title=html.escape(title), body=body), encoding="utf-8")
    return report


_PAGE = """<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<title>{title}</title>
<style>
body {{ font-family: system-ui, sans-serif; margin: 2em auto; max-width: 1100px; padding: 0 1em; color: #222; }}
table {{ border-collapse: collapse; margin: 1em 0; }}
th, td {{ border: 1px solid #ccc; padding: 0.3em 0.6em; text-align: left; vertical-align: top; }}
th {{ background: #f3f3f3; }}
td.num {{ text-align: right; font-variant-numeric: tabular-nums; }}
figure {{ display: inline-block; margin: 0.5em; }}
figure img {{ max-width: 100%; }}
figcaption {{ font-size: 0.85em; color: #555; }}
pre {{ white-space: pre-wrap; max-height: 20em; overflow: auto; margin: 0; }}
.meta {{ color: #666; }}
.call {{ background: #e8f0fe; font-weight: 600; }}
.result {{ background: #e6f4ea; }}
</style>
</head>
<body>
{body}
</body>
</html>
"""


def _format_number(value: float) -> str:
    return f"{value:.6g}"


def _format_duration(seconds: float) -> str:
    minutes, secs = divmod(round(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h {minutes:02d}m {secs:02d}s" if hours else f"{minutes}m {secs:02d}s"


def _summary_html(log_history: list[dict[str, Any]]) -> str:
    """Run facts (steps, epochs, wall time) and, per metric, its final value, where it was logged, and its range."""
    series = _collect_series(log_history)
    facts = [("Steps", _format_number(max(row["step"] for row in log_history)))]
    if series.get("epoch", Series([], [])).values:
        facts.append(("Epochs", _format_number(series["epoch"].values[-1])))
    if series.get("train_runtime", Series([], [])).values:
        facts.append(("Wall time", _format_duration(series["train_runtime"].values[-1])))
    fact_rows = "".join(f"<tr><th>{label}</th><td>{value}</td></tr>" for label, value in facts)
    metric_rows = []
    for key, points in series.items():
        if key == "epoch":
            continue
        if points.values:
            cells = [points.values[-1], points.steps[-1], min(points.values), max(points.values)]
            numbers_html = "".join(f'<td class="num">{_format_number(cell)}</td>' for cell in cells)
        else:
            numbers_html = '<td class="num">no finite value</td>' + '<td class="num"></td>' * 3
        count_html = f'<td class="num">{len(points.values)}</td>'
        metric_rows.append(f"<tr><td>{html.escape(display_name(key))}</td>{numbers_html}{count_html}</tr>")
    return (
        f"<h2>Summary</h2>\n<table>{fact_rows}</table>\n<table>\n"
        "<tr><th>metric</th><th>final</th><th>at step</th><th>min</th><th>max</th><th>points</th></tr>\n"
        + "\n".join(metric_rows)
        + "\n</table>"
    )


def _plots_html(groups: dict[str, dict[str, Series]], plots: dict[str, Path]) -> str:
    """Each PNG embedded as a data URI (the page opens offline), named in its title and listing its keys."""
    figures = []
    for name, path in plots.items():
        data = base64.b64encode(path.read_bytes()).decode("ascii")
        keys = html.escape(", ".join(map(display_name, groups[name])), quote=True)
        figures.append(
            f'<figure><img src="data:image/png;base64,{data}" alt="{html.escape(name, quote=True)}: {keys}" '
            f'title="{html.escape(path.name, quote=True)}">'
            f"<figcaption>{html.escape(path.name)}: {keys}</figcaption></figure>"
        )
    return "<h2>Plots</h2>\n" + "\n".join(figures)


def _as_text(value: Any) -> str:
    """Prompts and completions are plain text or chat messages; messages read as ``role: content`` lines."""
    if isinstance(value, str):
        return value
    if isinstance(value, list) and all(isinstance(message, dict) and "content" in message for message in value):
        return "\n".join(f"{message.get('role', '?')}: {message['content']}" for message in value)
    return json.dumps(value, ensure_ascii=False, indent=1)


def transcript_lines(messages: list[dict]) -> list[tuple[str, str]]:
    """A multi-turn completion as (kind, text) lines, kind a message's role or "call" / "result": each tool call
    with its arguments and each tool result on its own marked line, so a reader sees what the model asked and was
    told (the decoded completion text has lost the turns' roles)."""
    lines = []
    for message in messages:
        if message.get("role") == "tool":
            name, content = message.get("name", "tool"), _as_text(message.get("content", ""))
            lines.append(("result", f"[tool result: {name}] {content}"))
            continue
        if message.get("content"):
            role = str(message.get("role", "?"))
            lines.append((role, f"[{role}] {_as_text(message['content'])}"))
        for call in message.get("tool_calls") or []:
            function = call.get("function", call)
            arguments = function.get("arguments", {})
            arguments = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
            lines.append(("call", f"[tool call: {function.get('name', '?')}] {arguments}"))
    return lines


def _reward_columns(records: list[dict[str, Any]]) -> list[str]:
    """Reward-function names from the records' optional ``rewards`` mapping (name -> that function's reward)."""
    names: dict[str, None] = {}
    for record in records:
        if isinstance(record.get("rewards"), dict):
            names.update(dict.fromkeys(map(str, record["rewards"])))
    return list(names)


def _number_cell(value: Any) -> str:
    number = _as_number(value)
    return f'<td class="num">{"" if number is None or not math.isfinite(number) else _format_number(number)}</td>'


def _completion_html(record: dict[str, Any]) -> str:
    """The completion cell: a tool-calling episode's transcript with its calls and results marked, else the text."""
    if not record.get("transcript"):
        return html.escape(_as_text(record["completion"]))
    return "\n".join(
        f'<span class="{kind}">{html.escape(text)}</span>' if kind in ("call", "result") else html.escape(text)
        for kind, text in transcript_lines(record["transcript"])
    )


def _completions_html(records: list[dict[str, Any]]) -> str:
    """Prompt, completion and total reward per record, plus one column per reward function where the records
    carry ``rewards`` (a function that gave no reward for a record leaves its cell empty)."""
    if not records:
        return ""
    functions = _reward_columns(records)
    rows = []
    for record in records:
        per_function = record.get("rewards") if isinstance(record.get("rewards"), dict) else {}
        cells = [
            f'<td class="num">{html.escape(str(record["step"]))}</td>',
            f"<td><pre>{html.escape(_as_text(record.get('prompt', '')))}</pre></td>",
            f"<td><pre>{_completion_html(record)}</pre></td>",
            _number_cell(record.get("reward")),
            *(_number_cell(per_function.get(name)) for name in functions),
        ]
        rows.append("<tr>" + "".join(cells) + "</tr>")
    # A reward model is named by its path; its last component reads better and is what TRL calls it.
    function_headers = "".join(
        f"<th>{html.escape(name.rstrip('/').rsplit('/', 1)[-1] or name)}</th>" for name in functions
    )
    return (
        "<h2>Sample completions</h2>\n<table>\n"
        f"<tr><th>step</th><th>prompt</th><th>completion</th><th>reward</th>{function_headers}</tr>\n"
        + "\n".join(rows)
        + "\n</table>"
    )
