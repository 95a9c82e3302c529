"""Timing a block of training code and logging the time under `profiling/Time taken/<name>` to the run's trackers
(Weights & Biases, MLflow, Trackio, whichever the run reports to and are installed), from the main process only."""

from __future__ import annotations

import functools
import importlib
import importlib.util
import time


class ProfilingContext:
    """`with ProfilingContext("Trainer.step", report_to=["wandb"], step=3): ...` times the block with
    `time.perf_counter` and logs `{metric_prefix}/{name}` (seconds) at `step` to each tracker of `report_to` that is
    installed and has a run. The last duration is kept in `duration`."""

    def __init__(
        self,
        name: str,
        report_to: list[str],
        is_main_process: bool = True,
        step: int | None = None,
        metric_prefix: str = "profiling/Time taken",
    ) -> None:
        self.name, self.report_to, self.is_main_process = name, list(report_to or []), is_main_process
        self.step, self.metric_prefix = step, metric_prefix
        self.duration: float | None = None
        self._start: float | None = None

    def __enter__(self):
        self._start = time.perf_counter()
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        if self._start is not None:
            self.duration = time.perf_counter() - self._start
            self._log({f"{self.metric_prefix}/{self.name}": self.duration})
        return False

    def _log(self, metrics: dict) -> None:
        if not self.is_main_process:
            return
        for tracker in self.report_to:
            if tracker in ("wandb", "trackio") and importlib.util.find_spec(tracker) is not None:
                module = importlib.import_module(tracker)
                if getattr(module, "run", None) is not None or tracker == "trackio":
                    module.log(metrics, step=self.step) if self.step is not None else module.log(metrics)
            elif tracker == "mlflow" and importlib.util.find_spec("mlflow") is not None:
                import mlflow

                if mlflow.active_run() is not None:
                    mlflow.log_metrics(metrics, step=self.step)


def profiling_context(trainer, name: str) -> ProfilingContext:
    """A `ProfilingContext` named `<trainer class>.<name>`, reporting where `trainer.args.report_to` says, at the
    trainer's global step, from its main process."""
    report_to = getattr(trainer.args, "report_to", None) or []
    report_to = [report_to] if isinstance(report_to, str) else report_to
    return ProfilingContext(
        f"{type(trainer).__name__}.{name}",
        report_to,
        is_main_process=trainer.accelerator.is_main_process,
        step=trainer.state.global_step,
    )


def profiling_decorator(func):
    """A trainer method decorated so that each call is timed by `profiling_context(self, func.__name__)`."""

    @functools.wraps(func)
    def wrapper(self, *args, **kwargs):
        with profiling_context(self, func.__name__):
            return func(self, *args, **kwargs)

    return wrapper


__all__ = ["ProfilingContext", "profiling_context", "profiling_decorator"]
