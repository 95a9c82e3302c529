"""TRL's `trl.experimental.async_distillation` path: re-exports of its config and trainer modules."""

from posttrain.experimental.async_distillation.async_distillation_config import AsyncDistillationConfig
from posttrain.experimental.async_distillation.async_distillation_trainer import AsyncDistillationTrainer, LocalTeacher

__all__ = ["AsyncDistillationConfig", "AsyncDistillationTrainer", "LocalTeacher"]
