"""End-of-run report: one PNG per metric group and a self-contained report.html in the output directory.

Everything is rebuilt from the Trainer's ``log_history`` (plus the optional ``completions.jsonl`` written by
the online trainers), so the same code serves the end of training and ``posttrain report OUTPUT_DIR`` on any run:
every trainer appends each log entry to ``metrics.jsonl`` as it logs, whatever the save strategy. Each quantity gets
its own panel (its own scale); matplotlib is imported only when a plot is drawn, so importing this module stays cheap.
"""

from __future__ import annotations

import html
import math
import re
from pathlib import Path
from typing import TYPE_CHECKING, Any

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

if TYPE_CHECKING:
    from matplotlib.figure import Figure

REPORT_NAME = "report.html"


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
            summary_html(log_history),
            plots_html(groups, plots),
            completions_html(completions),
        ]
    )
    report = output_dir / REPORT_NAME
    report.write_text(PAGE.format(title=html.escape(title), body=body), encoding="utf-8")
    return report
