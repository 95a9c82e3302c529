"""Links to the experiment trackers a run reports to (Comet, Trackio), and a table sent to Comet. Each returns None
or does nothing where the tracker is not installed or has no current run."""

from __future__ import annotations

import importlib.util


def get_comet_experiment_url() -> str | None:
    """The URL of the running Comet experiment, or None."""
    if importlib.util.find_spec("comet_ml") is None:
        return None
    import comet_ml

    experiment = comet_ml.get_running_experiment()
    return experiment.url if experiment is not None else None


def get_trackio_space_url() -> str | None:
    """The URL of the Trackio Space of the current run, or None (not installed, no run, or a local run)."""
    if importlib.util.find_spec("trackio") is None:
        return None
    import trackio

    run = getattr(getattr(trackio, "context_vars", None), "current_run", None)
    run = run.get() if run is not None else None
    space = getattr(run, "space_id", None)
    return f"https://huggingface.co/spaces/{space}" if space else None


def log_table_to_comet_experiment(name: str, table) -> None:
    """Logs the pandas DataFrame `table` as `name` to the running Comet experiment, if there is one."""
    if importlib.util.find_spec("comet_ml") is None:
        return
    import comet_ml

    experiment = comet_ml.get_running_experiment()
    if experiment is not None:
        experiment.log_table(tabular_data=table, filename=name)


__all__ = ["get_comet_experiment_url", "get_trackio_space_url", "log_table_to_comet_experiment"]
