"""The training report's page: report.html's template and its sections (the run's summary table, the inline SVG
plots, sample completions with tool-calling transcripts marked), as HTML text."""

from __future__ import annotations

import html
import json
import math
from pathlib import Path
from typing import Any

from posttrain.training.report_data import Series, as_number, collect_series, display_name

PAGE = """<!DOCTYPE html>
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
figure svg {{ max-width: 100%; height: auto; display: block; }}
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


def summary_html(log_history: list[dict[str, Any]]) -> str:
    """Run facts (steps, epochs, wall time) and, per metric, its final value, where it was logged, and its range."""
    series = collect_series(log_history)
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


def plots_html(groups: dict[str, dict[str, Series]], plots: dict[str, tuple[Path, Any]]) -> str:
    """Each plot inlined as SVG markup (the page opens offline), captioned with its file's name and its keys."""
    figures = []
    for name, (path, chart) in plots.items():
        keys = html.escape(", ".join(map(display_name, groups[name])), quote=True)
        figures.append(
            f'<figure title="{html.escape(path.name, quote=True)}" aria-label="{html.escape(name, quote=True)}: '
            f'{keys}">{chart.svg(name=path.stem)}<figcaption>{html.escape(path.name)}: {keys}</figcaption></figure>'
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
    number = as_number(value)
    return f'<td class="num">{"" if number is None or not math.isfinite(number) else _format_number(number)}</td>'


def _completion_html(record: dict[str, Any]) -> str:
    """The completion cell: a tool-calling episode's transcript with its calls and results marked, else the text."""
    if not record.get("transcript"):
        return html.escape(_as_text(record["completion"]))
    return "\n".join(
        f'<span class="{kind}">{html.escape(text)}</span>' if kind in ("call", "result") else html.escape(text)
        for kind, text in transcript_lines(record["transcript"])
    )


def completions_html(records: list[dict[str, Any]]) -> str:
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
