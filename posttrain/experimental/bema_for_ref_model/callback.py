"""BEMA as the DPO reference (TRL's `trl.experimental.bema_for_ref_model`): the reference becomes a lagged,
smoothed copy of the policy, its BEMA weights (Block & Zhang 2025, arXiv:2508.00180), refreshed every
`ref_model_update_freq` steps.

`BEMACallback` is posttrain's BEMA callback plus the reference update; `DPOTrainer` is posttrain's DPO trainer whose
callbacks receive its reference model (``ref_model`` keyword) at every event, which the update needs.
"""

from __future__ import annotations

import copy
import logging

import torch
from transformers.trainer_callback import CallbackHandler

from posttrain.callbacks.bema import BEMACallback as _BEMACallback
from posttrain.errors import ConfigError
from posttrain.models.reference import REFERENCE_ADAPTER, add_reference_adapter, is_peft_model, unwrap

logger = logging.getLogger("posttrain")


class CallbackHandlerWithRefModel(CallbackHandler):
    """Passes ``ref_model`` (None when the reference is the PEFT policy's adapter) to every callback event."""

    def __init__(self, callbacks, model, ref_model, processing_class, optimizer, lr_scheduler):
        super().__init__(callbacks, model, processing_class, optimizer, lr_scheduler)
        self.ref_model = ref_model

    def call_event(self, event, args, state, control, **kwargs):
        kwargs.setdefault("ref_model", self.ref_model)
        return super().call_event(event, args, state, control, **kwargs)


class BEMACallback(_BEMACallback):
    """posttrain's `BEMACallback` (see posttrain.callbacks.bema for the update rule and the first eight arguments)
    that can also load its BEMA weights into the reference model.

    With `update_ref_model`, at every step t >= `ref_model_update_after` with (t - `ref_model_update_after`) a
    multiple of `ref_model_update_freq`, the reference takes the current BEMA weights θ'. A separate reference model
    gets all of them; with a PEFT policy (no separate reference) the adapter part of θ' is copied into the policy's
    frozen "ref" adapter (created on first use from the adapter as it is), so that the reference is base + BEMA of
    the adapter, which is the BEMA of the whole policy since the base does not train. Needs the trainer of this
    module (`posttrain.experimental.bema_for_ref_model.DPOTrainer`), which hands callbacks the reference.
    """

    def __init__(
        self,
        update_freq: int = 400,
        ema_power: float = 0.5,
        bias_power: float = 0.2,
        lag: int = 10,
        update_after: int = 0,
        multiplier: float = 1.0,
        min_ema_multiplier: float = 0.0,
        device: str = "cpu",
        update_ref_model: bool = False,
        ref_model_update_freq: int = 400,
        ref_model_update_after: int = 0,
    ):
        super().__init__(update_freq, ema_power, bias_power, lag, update_after, multiplier, min_ema_multiplier, device)
        if ref_model_update_freq < 1:
            raise ConfigError(f"BEMACallback: ref_model_update_freq={ref_model_update_freq} must be >= 1.")
        self.update_ref_model = update_ref_model
        self.ref_model_update_freq, self.ref_model_update_after = ref_model_update_freq, ref_model_update_after

    @torch.no_grad()
    def on_step_end(self, args, state, control, model=None, **kwargs):
        super().on_step_end(args, state, control, model=model, **kwargs)
        step = state.global_step
        if not self.update_ref_model or step < self.ref_model_update_after:
            return
        if (step - self.ref_model_update_after) % self.ref_model_update_freq:
            return
        if "ref_model" not in kwargs:
            raise ConfigError(
                "BEMACallback(update_ref_model=True) needs the trainer to pass its reference model to "
                "callbacks; use posttrain.experimental.bema_for_ref_model.DPOTrainer."
            )
        self.load_into_reference(model, kwargs["ref_model"])
        logger.info("BEMACallback: step %d, the reference model now holds the BEMA weights", step)

    @torch.no_grad()
    def load_into_reference(self, model, ref_model) -> None:
        """Copies the BEMA weights into `ref_model`, or into the PEFT `model`'s "ref" adapter when it is None."""
        if ref_model is not None:
            ref = unwrap(ref_model)
            source = self.running_model
            if is_peft_model(source) and not is_peft_model(ref):
                source = copy.deepcopy(source).merge_and_unload()  # the full BEMA weights of base + adapter
            try:
                ref.load_state_dict(source.state_dict())
            except RuntimeError as error:
                raise ConfigError(
                    "BEMACallback(update_ref_model=True): the reference model's parameters do not "
                    "match the policy's, so the BEMA weights cannot be loaded into it. Use a "
                    f"reference of the policy's architecture. ({error})"
                ) from error
            return
        policy = unwrap(model)
        if not is_peft_model(policy):
            raise ConfigError(
                "BEMACallback(update_ref_model=True): the trainer has no reference model to update "
                "(its reference log-probs were precomputed?); set precompute_ref_log_probs=False."
            )
        if REFERENCE_ADAPTER not in policy.peft_config:
            add_reference_adapter(policy)
        params = dict(policy.named_parameters())
        for name, value in self.running_model.named_parameters():
            if ".default." in name:
                params[name.replace(".default.", f".{REFERENCE_ADAPTER}.")].copy_(value.to(params[name].device))


__all__ = ["BEMACallback", "CallbackHandlerWithRefModel"]
