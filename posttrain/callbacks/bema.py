"""BEMA: bias-corrected exponential moving average of the weights (Block & Zhang, 2025,
arXiv:2508.00180)."""

from __future__ import annotations

import copy
import logging
import os

import torch
from transformers import TrainerCallback

from posttrain.models.reference import unwrap

logger = logging.getLogger("posttrain")


class BEMACallback(TrainerCallback):
    r"""Keeps a bias-corrected moving average (BEMA) of the weights during training, for a smoother final model.

    Keeps a BEMA copy of the model and saves it to ``<output_dir>/bema`` when training ends.

    With :math:`\tau` = `update_after`, at step :math:`\tau` the trainable weights are snapshotted into
    :math:`\theta_0` and the EMA; then every `update_freq` steps :math:`t` (the global step):

    .. math::
        \beta_t = \max((\rho + \gamma t)^{-\kappa}, \beta_{min}),\quad
        \alpha_t = (\rho + \gamma t)^{-\eta},\quad
        \mathrm{EMA}_t = (1 - \beta_t)\,\mathrm{EMA} + \beta_t\,\theta_t,\quad
        \theta'_t = \mathrm{EMA}_t + \alpha_t (\theta_t - \theta_0)

    with :math:`\rho` = `lag`, :math:`\gamma` = `multiplier`, :math:`\kappa` = `ema_power`, :math:`\eta` =
    `bias_power`, :math:`\beta_{min}` = `min_ema_multiplier`. The bias correction removes the lag a plain EMA
    has early in training while keeping most of its variance reduction. Buffers live on `device` (keep it off
    the training accelerator to spare its memory); `running_model` holds :math:`\theta'`. Frozen parameters
    (e.g. a LoRA base) are copied once and not averaged.

    See docs/trackers.md.
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
    ):
        if update_freq < 1:
            raise ValueError(f"BEMACallback: update_freq must be >= 1, got {update_freq}.")
        self.update_freq, self.ema_power, self.bias_power, self.lag = update_freq, ema_power, bias_power, lag
        self.update_after, self.multiplier, self.min_ema_multiplier = update_after, multiplier, min_ema_multiplier
        self.device = device
        self.param_names: list[str] = []
        self.thetat_params: list[torch.Tensor] = []  # the live training parameters
        self.theta0_params: list[torch.Tensor] = []
        self.ema_params: list[torch.Tensor] = []
        self.running_params: list[torch.Tensor] = []
        self.running_model = None

    def _ema_beta(self, step: int) -> float:
        return max((self.lag + self.multiplier * step) ** (-self.ema_power), self.min_ema_multiplier)

    def _bema_alpha(self, step: int) -> float:
        return (self.lag + self.multiplier * step) ** (-self.bias_power)

    @torch.no_grad()
    def on_train_begin(self, args, state, control, model=None, **kwargs):
        model = unwrap(model)
        self.running_model = copy.deepcopy(model).to(self.device).eval()
        running = dict(self.running_model.named_parameters())
        for name, param in model.named_parameters():
            if param.requires_grad:
                self.param_names.append(name)
                self.thetat_params.append(param)
                self.theta0_params.append(param.detach().clone().to(self.device))
                self.ema_params.append(param.detach().clone().to(self.device))
                self.running_params.append(running[name])

    @torch.no_grad()
    def _update_bema_weights(self, step: int) -> None:
        beta, alpha = self._ema_beta(step), self._bema_alpha(step)
        for theta_t, theta_0, ema, out in zip(
            self.thetat_params, self.theta0_params, self.ema_params, self.running_params
        ):
            theta_t = theta_t.detach().to(self.device)
            ema.mul_(1 - beta).add_(theta_t, alpha=beta)
            out.copy_(ema + alpha * (theta_t - theta_0))

    @torch.no_grad()
    def on_step_end(self, args, state, control, model=None, **kwargs):
        step = state.global_step
        if step < self.update_after:
            return
        if step == self.update_after:
            for theta_t, theta_0, ema in zip(self.thetat_params, self.theta0_params, self.ema_params):
                theta_0.copy_(theta_t)
                ema.copy_(theta_t)
        elif (step - self.update_after) % self.update_freq == 0:
            self._update_bema_weights(step)

    def on_train_end(self, args, state, control, **kwargs):
        if state.is_world_process_zero and self.running_model is not None:
            path = os.path.join(args.output_dir, "bema")
            self.running_model.save_pretrained(path)
            logger.info("Saved the BEMA model to %s", path)
