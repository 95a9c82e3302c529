"""Checkpoints that a crash cannot take away.

transformers writes checkpoint-N in place and then deletes the old ones beyond `save_total_limit`, so a kill
mid-save leaves a folder that looks complete, and a kill right after the rotation can leave nothing complete at
all. Here a marker file is written last (fsynced) to tell complete checkpoints apart, resuming skips the rest, and
old checkpoints are deleted only once the new one is complete — each losing its marker before its files.
"""

from __future__ import annotations

import logging
import os
import re
import shutil

import torch
from transformers import Trainer, TrainerCallback

logger = logging.getLogger("posttrain")

CHECKPOINT_MARKER = "posttrain_checkpoint_complete"
TRAINER_STATE_FILE = "posttrain_trainer_state.pt"  # what a trainer keeps beyond transformers' (see below)


def checkpoint_steps(root: str) -> list[int]:
    """Steps of the checkpoint-N folders in `root`, newest first."""
    if not os.path.isdir(root):
        return []
    return sorted(
        (int(m.group(1)) for name in os.listdir(root) if (m := re.fullmatch(r"checkpoint-(\d+)", name))), reverse=True
    )


def is_complete(folder: str) -> bool:
    return os.path.exists(os.path.join(folder, CHECKPOINT_MARKER))


def rotate(root: str, keep: int | None, protected: set[str]) -> None:
    """Deletes the oldest checkpoints beyond `keep`, torn ones first, never one in `protected` or the newest
    complete one."""
    if not keep or keep <= 0:
        return
    folders = [os.path.join(root, f"checkpoint-{step}") for step in checkpoint_steps(root)]
    newest_complete = next((f for f in folders if is_complete(f)), None)
    protected = {os.path.normpath(p) for p in protected} | {newest_complete}
    candidates = sorted((f for f in folders if f not in protected), key=lambda f: (is_complete(f), -folders.index(f)))
    for folder in candidates[: max(len(folders) - max(keep, len(protected & set(folders))), 0)]:
        marker = os.path.join(folder, CHECKPOINT_MARKER)
        if os.path.exists(marker):
            os.remove(marker)  # a kill during the deletion must not leave a "complete" half-deleted folder
        shutil.rmtree(folder, ignore_errors=True)


LOG_WINDOW = "_log_window"  # the key of the logging window in a checkpoint's trainer state


class _RestoreLogWindow(TrainerCallback):
    """Gives a resumed trainer its checkpoint's logging window once transformers has reset its own."""

    def __init__(self, trainer) -> None:
        self.trainer = trainer

    def on_train_begin(self, args, state, control, **kwargs):
        self.trainer.restore_log_window()


class CheckpointMixin(Trainer):
    CHECKPOINT_MARKER = CHECKPOINT_MARKER

    def train(self, *args, **kwargs):
        if not any(isinstance(c, _RestoreLogWindow) for c in self.callback_handler.callbacks):
            self.add_callback(_RestoreLogWindow(self))
        return super().train(*args, **kwargs)

    def _save_checkpoint(self, model, trial):
        limit = self.args.save_total_limit
        self.args.save_total_limit = None  # transformers would rotate before our marker says the new one is whole
        try:
            super()._save_checkpoint(model, trial)
        finally:
            self.args.save_total_limit = limit
        folder = os.path.join(self._get_output_dir(trial=trial), f"checkpoint-{self.state.global_step}")
        state = self.checkpoint_state()
        window = self._log_window()
        if window is not None:
            state = {**state, LOG_WINDOW: window}
        if state:
            rank = self.accelerator.process_index
            torch.save(state, os.path.join(folder, TRAINER_STATE_FILE if rank == 0 else f"{TRAINER_STATE_FILE}.{rank}"))
        self.accelerator.wait_for_everyone()
        if self.args.should_save:
            root = self._get_output_dir(trial=trial)
            with open(os.path.join(root, f"checkpoint-{self.state.global_step}", CHECKPOINT_MARKER), "w") as f:
                f.write(str(self.state.global_step))
                f.flush()
                os.fsync(f.fileno())
            best = self.state.best_model_checkpoint
            rotate(root, limit, {best} if best else set())

    # A trainer whose resume needs more than the weights, optimizer, scheduler and RNG (a reference model that
    # changes, a pending rollout, running statistics) returns it from `checkpoint_state` (per process: tensors,
    # numbers, lists, dicts) and takes it back in `load_checkpoint_state`.
    def checkpoint_state(self) -> dict:
        return {}

    def load_checkpoint_state(self, state: dict) -> None:
        if state:
            raise NotImplementedError(f"{type(self).__name__} saved state it cannot load: {sorted(state)}")

    def _log_window(self) -> dict | None:
        """What has been summed or collected since the last log, when a checkpoint falls inside a logging window
        (logging_steps > 1): the loss sum, the step of the last log, and the metric buffers. Without it a resumed
        run would log the window's mean over its resumed steps only."""
        metrics = getattr(self, "_metrics", None) or {}
        buffers = {mode: {k: list(v) for k, v in values.items() if v} for mode, values in metrics.items()}
        last_logged = getattr(self, "_globalstep_last_logged", self.state.global_step)
        if last_logged == self.state.global_step and not any(buffers.values()):
            return None
        loss = getattr(self, "_tr_loss", None)
        return {
            "loss_sum": None if loss is None else loss.detach().clone(),
            "last_logged": last_logged,
            "metrics": buffers,
        }

    def restore_log_window(self) -> None:
        """Puts a checkpoint's logging window back (called when training begins, after transformers has reset its
        logging state)."""
        window, self._resumed_log_window = getattr(self, "_resumed_log_window", None), None
        if window is None:
            return
        if window["loss_sum"] is not None:
            self._tr_loss = self._tr_loss + window["loss_sum"].to(self._tr_loss.device)
        self._globalstep_last_logged = window["last_logged"]
        for mode, values in window["metrics"].items():
            for key, buffer in values.items():
                self._metrics[mode][key] = list(buffer) + list(self._metrics[mode][key])

    def _load_optimizer_and_scheduler(self, checkpoint):
        super()._load_optimizer_and_scheduler(checkpoint)
        if checkpoint is None:
            return
        rank = self.accelerator.process_index
        path = os.path.join(checkpoint, TRAINER_STATE_FILE if rank == 0 else f"{TRAINER_STATE_FILE}.{rank}")
        if os.path.exists(path):
            device = self.accelerator.device  # torch.load rejects an indexed CPU ("cpu:0", a launched CPU run)
            state = torch.load(path, map_location="cpu" if device.type == "cpu" else device, weights_only=False)
            self._resumed_log_window = state.pop(LOG_WINDOW, None)
            self.load_checkpoint_state(state)

    def last_complete_checkpoint(self) -> str | None:
        """The newest checkpoint folder in output_dir whose save finished, or None."""
        for step in checkpoint_steps(self.args.output_dir):
            folder = os.path.join(self.args.output_dir, f"checkpoint-{step}")
            if is_complete(folder):
                return folder
            logger.warning("Skipping %s: its save did not finish (no completion marker).", folder)
        return None
