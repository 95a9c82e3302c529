"""End-of-run report: one SVG plot per metric group and a self-contained report.html in the output directory.

Everything is rebuilt from the Trainer's ``log_history`` (plus the optional ``completions.jsonl`` written by
the online trainers), so the same code serves the end of training and ``posttrain report OUTPUT_DIR`` on any run:
every trainer appends each log entry to ``metrics.jsonl`` as it logs, whatever the save strategy. Each quantity gets
its own panel (its own scale). The plots are SVG written by ``svg_plot`` (no plotting library is imported), inlined
in report.html and also saved as plot_<group>.svg files.
"""

from __future__ import annotations

import html
import re
from pathlib import Path
from typing import Any

from posttrain.errors import DataError
from posttrain.training.report_data import (
    COMPLETIONS_NAME,
    EVAL_PREFIX,
    Series,
    display_name,
    load_log_history,
    metric_groups,
    sample_completions,
)
from posttrain.training.report_html import PAGE, completions_html, plots_html, summary_html
from posttrain.training.svg_plot import Chart, Level, Panel

REPORT_NAME = "report.html"


def panels(lines: dict[str, Series]) -> dict[str, dict[str, Series]]:
    """Quantity -> its lines: a train metric and its ``eval_`` twin share a panel (same scale), nothing else does."""
    grouped: dict[str, dict[str, Series]] = {}
    for key, points in lines.items():
        grouped.setdefault(key.removeprefix(EVAL_PREFIX), {})[key] = points
    return grouped


def plot_group(name: str, lines: dict[str, Series]) -> Chart:
    """Draw one group, one panel per quantity with its own y scale, against the step.

    Eval lines are dashed with markers (they are sparse). A metric logged once is a line, not a lone dot: a train
    value over the logging window it averages, an eval value as a level across the panel.
    """
    quantities = panels(lines)
    drawn = []
    for quantity, quantity_lines in quantities.items():
        panel = Panel(title="" if display_name(quantity) == name else display_name(quantity), xlabel="step")
        for key, points in quantity_lines.items():
            _draw_series(panel, key, points)
        drawn.append(panel)
    return Chart(name, drawn, columns=1 if len(quantities) == 1 else 2)


def _draw_series(panel: Panel, key: str, points: Series) -> None:
    is_eval = key.startswith(EVAL_PREFIX)
    markers = is_eval or len(points.steps) < 20
    line = panel.add_line(display_name(key), points.steps, points.values, dashed=is_eval, markers=markers)
    if len(points.steps) != 1:
        return
    if is_eval or points.window_start >= points.steps[0]:
        panel.levels.append(Level(points.values[0], line.color))
    else:
        panel.levels.append(Level(points.values[0], line.color, points.window_start, points.steps[0], dotted=False))


def _plot_file_name(group: str, taken: set[str]) -> str:
    """``plot_<slug>.svg``, with a numeric suffix when two group names slug to the same file."""
    slug = re.sub(r"[^a-z0-9]+", "_", group.lower()).strip("_") or "metric"
    name, suffix = f"plot_{slug}.svg", 2
    while name in taken:
        name, suffix = f"plot_{slug}_{suffix}.svg", suffix + 1
    taken.add(name)
    return name


def save_plots(groups: dict[str, dict[str, Series]], output_dir: str | Path) -> dict[str, tuple[Path, Chart]]:
    """Write one SVG file per group into ``output_dir``; returns group name -> (its path, its chart)."""
    taken: set[str] = set()
    plots = {}
    for name, lines in groups.items():
        path = Path(output_dir) / _plot_file_name(name, taken)
        chart = plot_group(name, lines)
        path.write_text(chart.svg(name=path.stem, standalone=True), encoding="utf-8")
        plots[name] = path, chart
    return plots


def write_report(
    output_dir: str | Path, log_history: list[dict[str, Any]] | None = None, title: str | None = None
) -> Path:
    """Write the SVG plots and report.html into ``output_dir``; returns report.html's path.

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
            summary_html(log_history),
            plots_html(groups, plots),
            completions_html(completions),
        ]
    )
    report = output_dir / REPORT_NAME
    report.write_text(PAGE.format(title=html.escape(title), body=body), encoding="utf-8")
    return report
