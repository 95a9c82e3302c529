"""A live training / evaluation display with rich."""

from __future__ import annotations

import importlib.util

from transformers import TrainerCallback
from transformers.trainer_utils import has_length


class RichProgressCallback(TrainerCallback):
    """A terminal progress display for training and evaluation (needs rich).

    Shows a training progress bar, an evaluation bar while evaluating, and the latest logged metrics as
    tables (one per ``group/`` prefix), on the main process. Needs ``rich`` (``pip install rich``).

    See docs/trackers.md.
    """

    def __init__(self):
        if importlib.util.find_spec("rich") is None:
            raise ImportError("RichProgressCallback requires the `rich` package. To install, run `pip install rich`.")
        self._reset()

    def _reset(self):
        self.training_bar = self.evaluation_bar = self.training_task = self.evaluation_task = None
        self.rich_group = self.rich_console = self.training_status = self.current_step = None

    def on_train_begin(self, args, state, control, **kwargs):
        if not state.is_world_process_zero:
            return
        from rich.console import Console, Group
        from rich.live import Live
        from rich.panel import Panel
        from rich.progress import Progress

        self.training_bar, self.evaluation_bar, self.rich_console = Progress(), Progress(), Console()
        self.training_status = self.rich_console.status("Nothing to log yet ...")
        self.rich_group = Live(
            Panel(Group(self.training_bar, self.evaluation_bar, self.training_status)), console=self.rich_console
        )
        self.rich_group.start()
        self.training_task = self.training_bar.add_task("[blue]Training  ", total=state.max_steps)
        self.current_step = 0

    def on_step_end(self, args, state, control, **kwargs):
        if state.is_world_process_zero and self.training_bar is not None:
            self.training_bar.update(self.training_task, advance=state.global_step - self.current_step, update=True)
            self.current_step = state.global_step

    def on_prediction_step(self, args, state, control, eval_dataloader=None, **kwargs):
        if not state.is_world_process_zero or self.evaluation_bar is None or not has_length(eval_dataloader):
            return
        if self.evaluation_task is None:
            self.evaluation_task = self.evaluation_bar.add_task("[blue]Evaluation", total=len(eval_dataloader))
        self.evaluation_bar.update(self.evaluation_task, advance=1, update=True)

    def _end_evaluation(self, state):
        if state.is_world_process_zero and self.evaluation_task is not None:
            self.evaluation_bar.remove_task(self.evaluation_task)
            self.evaluation_task = None

    def on_evaluate(self, args, state, control, **kwargs):
        self._end_evaluation(state)

    def on_predict(self, args, state, control, **kwargs):
        self._end_evaluation(state)

    def on_log(self, args, state, control, logs=None, **kwargs):
        if not (state.is_world_process_zero and self.training_bar is not None):
            return
        from rich.columns import Columns
        from rich.panel import Panel
        from rich.table import Table

        groups: dict[str | None, dict] = {}
        for key, value in (logs or {}).items():
            group, name = key.split("/", 1) if "/" in key else (None, key)
            groups.setdefault(group, {})[name] = value
        panels = []
        for group, metrics in groups.items():
            table = Table(title=f"[bold blue]{group}[/]" if group else None, header_style="bold magenta", box=None)
            table.add_column("Metric", justify="left", no_wrap=True)
            table.add_column("Value", justify="right")
            for name, value in metrics.items():
                table.add_row(name, f"{value:.3f}" if isinstance(value, (int, float)) else str(value))
            panels.append(Panel(table, border_style="cyan", padding=(0, 1)))
        self.training_status.update(
            Panel(
                Columns(panels, equal=False, expand=True),
                title=f"[bold green]Step {state.global_step}[/bold green]",
                border_style="green",
            )
        )

    def on_train_end(self, args, state, control, **kwargs):
        if state.is_world_process_zero and self.rich_group is not None:
            self.rich_group.stop()
            self._reset()
