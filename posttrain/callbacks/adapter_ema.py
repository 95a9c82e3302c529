"""An exponential moving average of a PEFT adapter, kept as a second adapter of the same model (TRL's
`PEFTAdapterEMACallback`, for a self-distillation teacher that is the student's averaged adapter on the shared base).

At the start of training the model gets a second adapter (`teacher_adapter_name`, the student adapter's config)
whose weights, and the float32 shadow copy they are loaded from, start at zero. Every `sync_steps` optimizer steps

    shadow <- (1 - update_rate) * shadow + update_rate * student adapter

and the shadow is loaded into the teacher adapter. The student adapter stays the active, trained one; the teacher
adapter never trains.
"""

from __future__ import annotations

import torch
from transformers import TrainerCallback

from posttrain.errors import ConfigError

__all__ = ["PEFTAdapterEMACallback"]


class PEFTAdapterEMACallback(TrainerCallback):
    """`PEFTAdapterEMACallback(model, teacher_adapter_name="teacher", update_rate=0.05, sync_steps=1)`."""

    def __init__(
        self,
        model,
        teacher_adapter_name: str = "teacher",
        update_rate: float = 0.05,
        sync_steps: int = 1,
        accelerator=None,
    ):
        if not 0.0 < update_rate <= 1.0:
            raise ConfigError(f"update_rate={update_rate} must lie in (0, 1] (1.0: the teacher copies the student).")
        if sync_steps < 1:
            raise ConfigError(f"sync_steps={sync_steps} must be at least 1 (optimizer steps between updates).")
        self.model, self.teacher_adapter_name = model, teacher_adapter_name
        self.update_rate, self.sync_steps, self.accelerator = update_rate, sync_steps, accelerator
        self.shadow_weights: dict[str, torch.Tensor] | None = None
        self.student_adapter_name: str | None = None

    def _peft_model(self):
        return self.accelerator.unwrap_model(self.model) if self.accelerator is not None else self.model

    def _student_state(self) -> dict[str, torch.Tensor]:
        from peft import get_peft_model_state_dict

        return get_peft_model_state_dict(self._peft_model(), adapter_name=self.student_adapter_name)

    def _load_teacher(self) -> None:
        from peft import set_peft_model_state_dict

        model = self._peft_model()
        set_peft_model_state_dict(model, self.shadow_weights, adapter_name=self.teacher_adapter_name)
        marker = f".{self.teacher_adapter_name}."
        for name, parameter in model.named_parameters():
            if marker in name:
                parameter.requires_grad_(False)

    def setup(self) -> None:
        """Adds the zero teacher adapter and its shadow (once)."""
        if self.shadow_weights is not None:
            return
        model = self._peft_model()
        if not hasattr(model, "peft_config"):
            raise ConfigError(
                "PEFTAdapterEMACallback averages a PEFT adapter, but the model has none (no peft_config)."
            )
        self.student_adapter_name = model.active_adapter or "default"
        if self.teacher_adapter_name in model.peft_config:
            raise ConfigError(
                f"The model already has an adapter named {self.teacher_adapter_name!r}; choose another "
                "teacher_adapter_name."
            )
        model.add_adapter(self.teacher_adapter_name, model.peft_config[self.student_adapter_name])
        model.set_adapter(self.student_adapter_name)  # the student stays the trained adapter
        self.shadow_weights = {
            key: torch.zeros_like(value, dtype=torch.float32) for key, value in self._student_state().items()
        }
        self._load_teacher()

    def on_train_begin(self, args, state, control, **kwargs):
        if self.accelerator is None:
            self.accelerator = kwargs.get("accelerator")
        self.setup()

    @torch.no_grad()
    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step % self.sync_steps:
            return
        self.setup()
        for key, value in self._student_state().items():
            if key in self.shadow_weights:
                self.shadow_weights[key].lerp_(value.float(), self.update_rate)
        self._load_teacher()
