"""TRL's `trl.experimental.server_distillation` path: re-exports of its config and trainer modules."""

from posttrain.experimental.server_distillation.server_distillation_config import ServerDistillationConfig
from posttrain.experimental.server_distillation.server_distillation_trainer import (
    ServerDistillationTrainer,
    TeacherServer,
    build_teacher_request_inputs,
    server_divergence,
    teacher_server_scores,
)

__all__ = [
    "ServerDistillationConfig",
    "ServerDistillationTrainer",
    "TeacherServer",
    "build_teacher_request_inputs",
    "server_divergence",
    "teacher_server_scores",
]
