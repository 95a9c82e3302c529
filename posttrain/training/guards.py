"""Guards around the training loop: a non-finite step is never applied, and a scheduler's SIGTERM costs no work.

Non-finite loss or gradient norm (`nonfinite_policy`): "error" (default) stops before the optimizer step with an
error naming the step, the quantity and the last complete checkpoint; "skip" drops the step's gradients (the
optimizer skips parameters without a gradient), counts it in the logs as `nonfinite_steps_skipped`, and stops
after `max_nonfinite_steps` such steps in a row.

SIGTERM / SIGINT (`checkpoint_on_signal`): the current optimizer step finishes, a checkpoint is written, and the
process exits with status 0 and one line saying where to resume from; a second signal ends it at once.
"""

from __future__ import annotations

import logging
import math
import signal
import threading

import torch
from transformers import Trainer, TrainerCallback

from posttrain.errors import NonFiniteError

logger = logging.getLogger("posttrain")

NONFINITE_POLICIES = ("error", "skip")
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


class _StopOnSignal(TrainerCallback):
    """Turns a received signal into "save, then stop" at the end of the current optimizer step."""

    def __init__(self, trainer: GuardMixin) -> None:
        self.trainer = trainer

    def on_step_end(self, args, state, control, **kwargs):
        if self.trainer.signal_received():
            control.should_save = True
            control.should_training_stop = True
        return control


class GuardMixin(Trainer):
    def _init_guards(self) -> None:
        self._nonfinite_loss: torch.Tensor | None = None  # on the device (training_step)
        self._nonfinite_in_a_row = 0
        self._nonfinite_skipped = 0
        self._signal: int | None = None
        self.add_callback(_StopOnSignal(self))

    # -- non-finite steps -------------------------------------------------------------------------
    def training_step(self, model, inputs, num_items_in_batch=None):
        loss = super().training_step(model, inputs, num_items_in_batch)
        # On the device, no sync per micro-batch: the step's first non-finite loss (else its last loss), checked
        # once, with the gradient norm, before the optimizer step.
        seen, value = self._nonfinite_loss, loss.detach().reshape(())
        self._nonfinite_loss = value if seen is None else torch.where(torch.isfinite(seen), value, seen)
        return loss

    def _get_grad_norm(self, model, grad_norm=None):
        """Called by transformers right before the optimizer step: the place to decide whether to apply it (one
        host sync a step: the flags below)."""
        grad_norm = super()._get_grad_norm(model, grad_norm)
        loss, self._nonfinite_loss = self._nonfinite_loss, None
        device = self.accelerator.device
        norm = 0.0 if grad_norm is None else grad_norm
        if hasattr(norm, "full_tensor"):  # FSDP2's norm is a replicated DTensor: reduce a plain tensor
            norm = norm.full_tensor()
        norm = torch.as_tensor(norm, device=device).float().reshape(())
        loss = torch.zeros((), device=device) if loss is None else loss.to(device).float()
        flags = torch.stack([~torch.isfinite(loss), ~torch.isfinite(norm)])
        if self.accelerator.num_processes > 1:
            flags = self.accelerator.reduce(flags.float(), reduction="sum") > 0
        if not flags.any():
            self._nonfinite_in_a_row = 0
            return grad_norm
        bad_loss = float(loss) if not math.isfinite(float(loss)) else None
        norm = float(norm)
        step = self.state.global_step + 1
        what = f"loss {bad_loss}" if bad_loss is not None else f"gradient norm {norm}"
        self._nonfinite_in_a_row += 1
        if self.args.nonfinite_policy == "skip" and self._nonfinite_in_a_row <= self.args.max_nonfinite_steps:
            model.zero_grad(set_to_none=True)
            self._nonfinite_skipped += 1
            logger.warning(
                "Step %d: %s is not finite; skipped the update (%d in a row, at most %d).",
                step,
                what,
                self._nonfinite_in_a_row,
                self.args.max_nonfinite_steps,
            )
            return grad_norm
        last = self.last_complete_checkpoint()
        in_a_row = f" ({self._nonfinite_in_a_row} steps in a row)" if self.args.nonfinite_policy == "skip" else ""
        raise NonFiniteError(
            f"Step {step}: {what} is not finite{in_a_row}; the update was not applied and training stopped. "
            + (
                f"The last complete checkpoint is {last}: resume from it with a lower learning_rate or "
                "max_grad_norm, or check the data of this step."
                if last
                else "No checkpoint was saved yet. Lower learning_rate or max_grad_norm, or check the data."
            )
            + " To skip such steps instead, set nonfinite_policy='skip'."
        )

    def log(self, logs, start_time=None):
        if self.args.nonfinite_policy == "skip" and "loss" in logs:
            logs["nonfinite_steps_skipped"] = float(self._nonfinite_skipped)
        super().log(logs, start_time)

    # -- signals ----------------------------------------------------------------------------------
    def signal_received(self) -> bool:
        received = self._signal is not None
        if self.accelerator.num_processes > 1:  # one process signalled: all stop at the same step
            flag = torch.tensor([float(received)], device=self.accelerator.device)
            received = bool(self.accelerator.reduce(flag, reduction="sum") > 0)
        return received

    def _on_signal(self, signum, frame) -> None:
        if self._signal is not None:  # the second signal: stop now
            signal.signal(signum, signal.SIG_DFL)
            signal.raise_signal(signum)
        self._signal = signum
        logger.warning(
            "Received %s: finishing this step, then saving a checkpoint and exiting (send it again to stop at once).",
            signal.Signals(signum).name,
        )

    def train(self, *args, **kwargs):
        if not self.args.checkpoint_on_signal or threading.current_thread() is not threading.main_thread():
            return super().train(*args, **kwargs)
        previous = {s: signal.signal(s, self._on_signal) for s in STOP_SIGNALS}
        try:
            output = super().train(*args, **kwargs)
        finally:
            for s, handler in previous.items():
                signal.signal(s, handler)
        if self._signal is not None:
            where = self.last_complete_checkpoint()
            print(
                f"posttrain: stopped by {signal.Signals(self._signal).name} after step {self.state.global_step}; "
                f"checkpoint {where} (resume with resume_from_checkpoint=True).",
                flush=True,
            )
            raise SystemExit(0)
        return output
