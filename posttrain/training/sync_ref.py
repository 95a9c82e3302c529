"""TR-DPO's reference-model sync (Gorbatovski et al. 2024)."""

from __future__ import annotations

import numbers

import torch
from torch import nn
from transformers import TrainerCallback

from posttrain.errors import ConfigError
from posttrain.models.reference import full_state_dict, gathered_weights, load_full_state_dict, named_weights


def mix_into_reference(policy: nn.Module, ref_model: nn.Module, alpha: float) -> None:
    """ref <- alpha * policy + (1 - alpha) * ref, parameter by parameter (matched by name); under ZeRO-3 and FSDP2
    (a collective there) on the parameters as the engines hold them."""
    policy_params, ref_params = named_weights(policy), named_weights(ref_model)
    with torch.no_grad(), gathered_weights(policy_params.values()), gathered_weights(ref_params.values(), modify=True):
        for name, ref_param in ref_params.items():
            ref_param.mul_(1 - alpha).add_(policy_params[name].detach().to(ref_param.dtype), alpha=alpha)


class SyncRefModelCallback(TrainerCallback):
    """TR-DPO's reference update as a callback (what `sync_ref_model=True` installs).

    TR-DPO: every `sync_steps` optimizer steps the reference moves towards the policy
    (ref <- alpha * policy + (1 - alpha) * ref), so the KL anchor follows training instead of holding it at
    the start.

    TRL's form, ``SyncRefModelCallback(ref_model, accelerator)``, reads ``ref_model_mixup_alpha`` and
    ``ref_model_sync_steps`` from the training arguments at each step; `alpha` / `sync_steps` fix them
    instead. The accelerator is not needed (models are unwrapped here) and is kept for the signature.

    See docs/trainers/dpo.md.
    """

    def __init__(
        self, ref_model: nn.Module, accelerator=None, alpha: float | None = None, sync_steps: int | None = None
    ):
        if isinstance(accelerator, numbers.Number):  # posttrain's earlier positional form (ref, alpha, steps)
            accelerator, alpha, sync_steps = None, accelerator, alpha if sync_steps is None else sync_steps
        self.ref_model, self.accelerator, self.alpha, self.sync_steps = ref_model, accelerator, alpha, sync_steps

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        missing = sorted(set(named_weights(self.ref_model)) - set(named_weights(model)))
        if missing:
            raise ConfigError(
                f"sync_ref_model: the reference has parameters the policy lacks (e.g. {missing[:3]}); TR-DPO "
                "needs a reference of the policy's architecture. Drop ref_model or set sync_ref_model=False."
            )

    def on_step_end(self, args, state, control, model=None, **kwargs):
        steps = self.sync_steps if self.sync_steps is not None else args.ref_model_sync_steps
        alpha = self.alpha if self.alpha is not None else args.ref_model_mixup_alpha
        if self.ref_model is not None and state.global_step % steps == 0:
            mix_into_reference(model, self.ref_model, alpha)


# A synced reference is trained state: a resumed run must start from the reference as it was at the checkpoint,
# not from a fresh copy of the initial policy. Trainers that add the callback save and restore it with these.
SYNC_REF_KEY = "sync_ref_model"


def _sync_callback(trainer) -> SyncRefModelCallback | None:
    return next((c for c in trainer.callback_handler.callbacks if isinstance(c, SyncRefModelCallback)), None)


def sync_ref_checkpoint_state(trainer) -> dict:
    """{SYNC_REF_KEY: the synced reference's state_dict} when `trainer` has a SyncRefModelCallback, else {}."""
    callback = _sync_callback(trainer)
    if callback is None or callback.ref_model is None:
        return {}
    return {SYNC_REF_KEY: full_state_dict(callback.ref_model)}  # full tensors: a sharded reference is gathered


def load_sync_ref_checkpoint_state(trainer, state: dict) -> None:
    """Takes SYNC_REF_KEY out of `state` and loads it into the callback's reference."""
    weights = state.pop(SYNC_REF_KEY, None)
    if weights is None:
        return
    callback = _sync_callback(trainer)
    if callback is None or callback.ref_model is None:
        raise ConfigError(
            "The checkpoint holds a TR-DPO reference model (it was saved with sync_ref_model=True), "
            "but this run does not sync one; resume with sync_ref_model=True or start a new run."
        )
    load_full_state_dict(callback.ref_model, weights)
