"""The teacher of self-distillation kept as a moving average of the student (TRL's `SyncTeacherModelCallback`): every
`teacher_sync_steps` optimizer steps, teacher <- rate * student + (1 - rate) * teacher, rate = `teacher_update_rate`."""

from __future__ import annotations

from posttrain.training.sync_ref import SyncRefModelCallback, mix_into_reference


class SyncTeacherModelCallback(SyncRefModelCallback):
    """`SyncTeacherModelCallback(teacher_model, accelerator=None)`: TR-DPO's reference update applied to a teacher,
    reading `teacher_sync_steps` and `teacher_update_rate` from the training arguments at each step."""

    def __init__(self, teacher_model, accelerator=None):
        super().__init__(teacher_model, accelerator)

    def on_step_end(self, args, state, control, model=None, **kwargs):
        if self.ref_model is not None and state.global_step % args.teacher_sync_steps == 0:
            mix_into_reference(model, self.ref_model, args.teacher_update_rate)


__all__ = ["SyncTeacherModelCallback"]
