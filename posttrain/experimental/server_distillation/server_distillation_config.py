"""TRL's `trl.experimental.server_distillation.server_distillation_config` path."""

from posttrain.experimental.server_distillation import ServerDistillationConfig

__all__ = ["ServerDistillationConfig"]
