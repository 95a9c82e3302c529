"""TRL's `trl.experimental.bema_for_ref_model.dpo_trainer` path: posttrain's DPOTrainer whose
callbacks receive its reference model (`ref_model` keyword) at every event, which BEMACallback(update_ref_model=True)
needs."""

from __future__ import annotations

from posttrain.errors import ConfigError
from posttrain.experimental.bema_for_ref_model.callback import CallbackHandlerWithRefModel
from posttrain.trainers.dpo import DPOTrainer as _DPOTrainer


class DPOTrainer(_DPOTrainer):
    """posttrain's `DPOTrainer`, same arguments; its callbacks receive ``ref_model`` at every event (for
    `BEMACallback(update_ref_model=True)`)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        updates = any(getattr(c, "update_ref_model", False) for c in self.callback_handler.callbacks)
        if updates and self.args.precompute_ref_log_probs:
            raise ConfigError(
                "BEMACallback(update_ref_model=True) changes the reference during training, so its "
                "log-probs cannot be precomputed; set precompute_ref_log_probs=False."
            )
        handler = self.callback_handler
        self.callback_handler = CallbackHandlerWithRefModel(
            handler.callbacks,
            handler.model,
            self.ref_model,
            handler.processing_class,
            handler.optimizer,
            handler.lr_scheduler,
        )


__all__ = ["DPOTrainer"]
