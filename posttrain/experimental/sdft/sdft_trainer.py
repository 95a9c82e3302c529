"""SDFT with TRL's `trl.experimental.sdft` API: self-distillation fine-tuning (Shenfeld et al. 2026, "Self-Distillation
Enables Continual Learning"), on posttrain's self-distillation base (posttrain/trainers/self_distillation.py): the
teacher is the model itself, given the prompt plus a `privileged_context` (e.g. a demonstration) through
`teacher_prompt_template`."""

from __future__ import annotations

from posttrain.experimental.sdft.sdft_config import SDFTConfig
from posttrain.generation.teacher_server import build_teacher_request_inputs
from posttrain.trainers.self_distillation import SelfDistillationTrainer
from posttrain.trainers.self_distillation_data import (
    privileged_text,
    with_user_text,
)


class SDFTTrainer(SelfDistillationTrainer):
    """`SDFTTrainer(model, args=SDFTConfig(...), train_dataset=...)`, TRL's keyword arguments in TRL's order.

    Data: a 'prompt' (text or messages) and a 'privileged_context' per row. Logged: TRL's
    self_distillation/distillation_loss, sdft/distillation_loss and completions/* keys.
    """

    _name = "SDFT"

    def __init__(
        self,
        model,
        args: SDFTConfig | None = None,
        train_dataset=None,
        eval_dataset=None,
        processing_class=None,
        callbacks=None,
        optimizers=(None, None),
        peft_config=None,
        **kwargs,
    ):
        args = args or SDFTConfig(output_dir="outputs/sdft")
        super().__init__(
            model, args, train_dataset, eval_dataset, processing_class, callbacks, optimizers, peft_config, **kwargs
        )

    def _teacher_raw_prompt(self, row: dict):
        """The teacher's prompt (text or messages): the row's prompt with its privileged context."""
        return with_user_text(
            row["prompt"],
            self.args.teacher_prompt_template,
            privileged_context=privileged_text(row.get("privileged_context")),
        )

    def _teacher_prompt(self, row: dict, index: int) -> list[int]:
        return self._prompt_ids(self._teacher_raw_prompt(row), index, self.args.max_prompt_length)

    def _generation_prompts(self, rows):
        if not self.args.generate_from_teacher:
            return None
        return [self._teacher_prompt(row, i) for i, row in enumerate(rows)]

    def _generation_raw_prompts(self, rows):
        if not self.args.generate_from_teacher:
            return super()._generation_raw_prompts(rows)
        return [self._teacher_raw_prompt(row) for row in rows]

    def _teacher_prompts(self, rows, prompts, completions, mode):
        return [self._teacher_prompt(row, i) for i, row in enumerate(rows)], [True] * len(rows)

    @property
    def keeps_rollout_logps(self) -> bool:  # TRL keeps none when the teacher's prompt generated the rollout
        return not self.args.generate_from_teacher


__all__ = ["SDFTConfig", "SDFTTrainer", "build_teacher_request_inputs"]
