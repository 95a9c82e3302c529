"""The online trainers' `log_completions`: a table of prompts, completions and rewards (total and per reward
function) printed to the console with rich at each log, and sent to every tracker the run reports to as a table
(W&B and trackio tables, an MLflow JSON table artifact, a TensorBoard text panel). A tool-calling episode is shown
as its transcript, each tool call and tool result on a marked line."""

from __future__ import annotations

import json
import math

from posttrain.training.report_html import transcript_lines

__all__ = ["completion_table", "completion_text", "log_completion_table", "print_completion_table"]


def _text(value, limit: int | None = None) -> str:
    text = value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)
    return text if limit is None or len(text) <= limit else text[:limit] + "…"


def completion_text(record: dict) -> str:
    """A record's completion as shown: its transcript with the tool calls and results marked, else its text."""
    if record.get("transcript"):
        return "\n".join(text for _, text in transcript_lines(record["transcript"]))
    return _text(record["completion"])


def _number(value) -> float | None:
    return None if value is None or (isinstance(value, float) and math.isnan(value)) else float(value)


def completion_table(records: list[dict], names: list[str]) -> tuple[list[str], list[list]]:
    """(columns, rows): step, prompt, completion, one column per reward function, then the total reward."""
    columns = ["step", "prompt", "completion", *names, "reward"]
    rows = []
    for record in records:
        per_function = record.get("rewards") or {}
        rows.append(
            [
                record["step"],
                _text(record["prompt"]),
                completion_text(record),
                *(_number(per_function.get(name)) for name in names),
                _number(record["reward"]),
            ]
        )
    return columns, rows


def print_completion_table(records: list[dict], names: list[str], step: int, max_chars: int = 400) -> None:
    """The table on the console (long prompts and completions are cut to `max_chars`)."""
    from rich.console import Console
    from rich.table import Table

    columns, rows = completion_table(records, names)
    table = Table(title=f"Completions at step {step}", show_lines=True)
    for column in columns:
        numeric = column not in ("prompt", "completion")
        table.add_column(column, justify="right" if numeric else "left", no_wrap=numeric)
    for row in rows:
        table.add_row(
            *(("-" if v is None else f"{v:.3f}" if isinstance(v, float) else _text(v, max_chars)) for v in row)
        )
    Console().print(table)


def log_completion_table(callbacks, records: list[dict], names: list[str], step: int) -> None:
    """Sends the table to each tracker callback of the run (transformers' integrations)."""
    columns, rows = completion_table(records, names)
    for callback in callbacks:
        kind = type(callback).__name__
        if kind == "WandbCallback" and getattr(callback, "_initialized", False):
            import wandb

            if wandb.run is not None:
                wandb.log({"completions": wandb.Table(columns=columns, data=rows)}, commit=False)
        elif kind == "TrackioCallback":
            import pandas as pd
            import trackio

            trackio.log({"completions": trackio.Table(dataframe=pd.DataFrame(rows, columns=columns))}, step=step)
        elif kind == "MLflowCallback" and getattr(callback, "_initialized", False):
            # transformers logs metrics asynchronously; log_table reads the run back, so let those writes land first
            # (a half-written metric file reads as "malformed").
            flush = getattr(callback._ml_flow, "flush_async_logging", None)
            if flush is not None:
                flush()
            callback._ml_flow.log_table(
                {c: [row[i] for row in rows] for i, c in enumerate(columns)},
                artifact_file=f"completions/step_{step:06d}.json",
            )
        elif kind == "TensorBoardCallback" and getattr(callback, "tb_writer", None) is not None:
            header = "| " + " | ".join(columns) + " |\n|" + "---|" * len(columns) + "\n"
            body = "".join(
                "| "
                + " | ".join("-" if v is None else _text(v).replace("|", "\\|").replace("\n", " ") for v in row)
                + " |\n"
                for row in rows
            )
            callback.tb_writer.add_text("completions", header + body, step)
