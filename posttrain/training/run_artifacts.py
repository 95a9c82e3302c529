"""What every run leaves in its output_dir, whatever the entry point (Python API, CLI, TRL scripts):

- ``metrics.jsonl``: every log entry (train and eval), one JSON object per line, appended and flushed as it is
  logged, so ``posttrain report DIR`` works on a run that saved no checkpoint or was killed;
- ``report.html`` and its SVG plots at the end of ``train()`` (``write_report=False`` turns this off);
- ``README.md``, a model card, at each checkpoint save and at the end of training.

Only the main process writes. BaseTrainer adds this callback in its ``__init__``.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

from transformers import TrainerCallback

logger = logging.getLogger("posttrain")

METRICS_NAME = "metrics.jsonl"


def _json_default(value):
    """Tensors and numpy scalars become numbers; anything else its text (a log line is never dropped)."""
    if hasattr(value, "item"):
        try:
            return value.item()
        except (TypeError, ValueError):
            pass
    return str(value)


def _dumps(row: dict) -> str:
    # json writes NaN/Infinity for non-finite floats and reads them back, which the report expects.
    return json.dumps(row, ensure_ascii=False, default=_json_default)


def _logs_by_steps(args) -> bool:
    return getattr(args.logging_strategy, "value", args.logging_strategy) == "steps"


class RunArtifactsCallback(TrainerCallback):
    """Writes metrics.jsonl as the run logs, then the report and the model card (see the module docstring).

    Holds the trainer so the model card can name its method, model and datasets.
    """

    def __init__(self, trainer):
        self.trainer = trainer

    @staticmethod
    def metrics_path(args) -> Path:
        return Path(args.output_dir) / METRICS_NAME

    def on_train_begin(self, args, state, control, **kwargs):
        # A fresh run starts the file over; a resumed one keeps exactly the history its checkpoint restored, so
        # rows logged after that checkpoint by the interrupted run are not counted twice.
        if state.is_world_process_zero:
            path = self.metrics_path(args)
            path.parent.mkdir(parents=True, exist_ok=True)
            with path.open("w", encoding="utf-8") as file:
                file.writelines(_dumps(row) + "\n" for row in state.log_history)

    def on_step_end(self, args, state, control, **kwargs):
        # The last steps' metrics would be dropped when max_steps is not a multiple of logging_steps (and a run
        # shorter than logging_steps would log nothing to plot): log the final partial window too.
        if _logs_by_steps(args) and state.max_steps > 0 and state.global_step >= state.max_steps:
            control.should_log = True

    @staticmethod
    def logged_final_window_off_schedule(args, state) -> bool:
        """Whether the last step's window was logged only because this callback asked for it (transformers'
        DefaultFlowCallback, which follows logging_steps, would not have logged it)."""
        steps = state.logging_steps
        return _logs_by_steps(args) and bool(steps) and state.global_step % steps != 0

    def on_log(self, args, state, control, logs=None, **kwargs):
        if not state.is_world_process_zero or not state.log_history:
            return
        path = self.metrics_path(args)
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("a", encoding="utf-8") as file:
            file.write(_dumps(state.log_history[-1]) + "\n")  # the entry Trainer.log just recorded, with its step
            file.flush()

    def on_save(self, args, state, control, **kwargs):
        if state.is_world_process_zero:
            self._write_model_card(args)

    def on_train_end(self, args, state, control, **kwargs):
        if not state.is_world_process_zero:
            return
        if getattr(args, "write_report", False):
            self._write_report(args, state)
        self._write_model_card(args)

    def _write_report(self, args, state) -> None:
        """report.html and its plots; a run without logged metrics only gets a warning."""
        from posttrain.errors import DataError
        from posttrain.training.report import write_report

        title = f"{getattr(self.trainer, '_name', 'posttrain')} run: {Path(args.output_dir).resolve().name}"
        try:
            path = write_report(args.output_dir, log_history=state.log_history, title=title)
        except DataError as err:
            logger.warning("No report written: %s", err)
        else:
            logger.info("Training report: %s", path)

    def _write_model_card(self, args) -> None:
        from posttrain.training.model_card import write_model_card

        try:
            write_model_card(self.trainer, args.output_dir)
        except OSError as err:  # a card is documentation: a full disk or read-only dir must not stop training
            logger.warning("No model card written to %s: %s", args.output_dir, err)


def default_output_dir(name, method: str) -> str:
    """TRL's default output_dir when no config is given: the last part of the model's name or path, then the
    method ("Qwen/Qwen2-0.5B/" with "SFT" -> "Qwen2-0.5B-SFT")."""
    return f"{str(name).rstrip('/').split('/')[-1]}-{method}"
