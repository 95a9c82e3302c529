"""Trainer callbacks shared by posttrain's trainers."""

from __future__ import annotations

import torch
from torch import nn
from transformers import TrainerCallback

from .errors import ConfigError
from .models.reference import unwrap


def mix_into_reference(policy: nn.Module, ref_model: nn.Module, alpha: float) -> None:
    """ref <- alpha * policy + (1 - alpha) * ref, parameter by parameter (matched by name)."""
    policy_params = dict(unwrap(policy).named_parameters())
    with torch.no_grad():
        for name, ref_param in unwrap(ref_model).named_parameters():
            ref_param.mul_(1 - alpha).add_(policy_params[name].detach().to(ref_param.dtype), alpha=alpha)


class SyncRefModelCallback(TrainerCallback):
    """TR-DPO (Gorbatovski et al. 2024): every `sync_steps` optimizer steps the reference moves towards the
    policy, so the KL anchor follows training instead of holding it at the start."""

    def __init__(self, ref_model: nn.Module, alpha: float, sync_steps: int):
        self.ref_model, self.alpha, self.sync_steps = ref_model, alpha, sync_steps

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        ref_names = {n for n, _ in unwrap(self.ref_model).named_parameters()}
        missing = sorted(ref_names - {n for n, _ in unwrap(model).named_parameters()})
        if missing:
            raise ConfigError(
                f"sync_ref_model: the reference has parameters the policy lacks (e.g. {missing[:3]}); TR-DPO "
                "needs a reference of the policy's architecture. Drop ref_model or set sync_ref_model=False."
            )

    def on_step_end(self, args, state, control, model=None, **kwargs):
        if state.global_step % self.sync_steps == 0:
            mix_into_reference(model, self.ref_model, self.alpha)
