"""What a training command shows: the latest loss / reward on the progress bar while it trains, then the run
report (report.html and the plots) and a one-screen summary."""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path
from typing import Any

from posttrain.errors import PosttrainError

LIVE_KEYS = ("loss", "reward", "eval_loss", "eval_reward")


def show_live_metrics(trainer) -> None:
    """Swap transformers' progress bar for one that also shows the latest loss / reward on the bar."""
    from transformers.trainer_callback import ProgressCallback

    class LiveProgressCallback(ProgressCallback):
        def on_log(self, args, state, control, logs=None, **kwargs):
            super().on_log(args, state, control, logs=logs, **kwargs)
            if self.training_bar is not None and logs:
                shown = {key: f"{logs[key]:.4g}" for key in LIVE_KEYS if isinstance(logs.get(key), (int, float))}
                if shown:
                    self.training_bar.set_postfix(shown)

    if trainer.pop_callback(ProgressCallback) is not None:
        trainer.add_callback(LiveProgressCallback())


def write_run_report(output_dir: str, log_history: list[dict[str, Any]]) -> Path | None:
    """report.html and its plots; a run without logged metrics only gets a warning."""
    from posttrain.training.report import write_report

    try:
        return write_report(output_dir, log_history)
    except PosttrainError as err:
        print(f"warning: no report written: {err}", file=sys.stderr)
        return None


def summary(name: str, trainer, report: Path | None, wall_seconds: float) -> str:
    """One screen: steps, processes, final metrics, where the model and report are, and the wall time."""
    from posttrain.training.report_data import RUN_STATISTICS

    state = trainer.state
    final: dict[str, float] = {}
    for row in state.log_history:
        for key, value in row.items():
            if key not in ("step", "epoch") and key not in RUN_STATISTICS and isinstance(value, (int, float)):
                final[key] = value
    run_means = [row["train_loss"] for row in state.log_history if "train_loss" in row]
    if run_means:
        final["train_loss (run mean)"] = run_means[-1]
    train = [f"{key} {value:.4g}" for key, value in final.items() if not key.startswith("eval_")]
    evaluation = [f"{key} {value:.4g}" for key, value in final.items() if key.startswith("eval_")]
    minutes, seconds = divmod(round(wall_seconds), 60)
    rows = [
        (
            "steps",
            f"{state.global_step} (epoch {state.epoch or 0:.3g}) on {trainer.args.world_size} process(es), "
            f"{trainer.args.device}",
        ),
        ("final", " | ".join(train) or "nothing logged (lower --logging_steps)"),
    ]
    if evaluation:
        rows.append(("eval", " | ".join(evaluation)))
    evals = [row for row in state.log_history if "eval_loss" in row]
    if len(evals) > 1:  # e.g. with eval_on_start: the held-out loss before and after training
        first, last = evals[0], evals[-1]
        rows.append(
            (
                "held-out",
                f"eval_loss {first['eval_loss']:.4g} at step {first['step']} -> "
                f"{last['eval_loss']:.4g} at step {last['step']}",
            )
        )
    rows += [
        ("model", f"saved to {Path(trainer.args.output_dir).resolve()}"),
        ("report", str(report.resolve()) if report else "not written"),
        ("wall time", f"{minutes}m {seconds:02d}s"),
    ]
    lines = [f"posttrain {name}: done"]
    for label, text in rows:
        lines.append(textwrap.fill(text, width=110, initial_indent=f"  {label:<10} ", subsequent_indent=" " * 13))
    return "\n".join(lines)
