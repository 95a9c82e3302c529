"""TRL's `trl.experimental.server_distillation.server_distillation_trainer` path, with the helpers TRL's module
defines under private names (the tail bucket and per-element generalized JSD of posttrain.losses.iw_opd)."""

from posttrain.experimental.server_distillation import (
    ServerDistillationConfig,
    ServerDistillationTrainer,
    build_teacher_request_inputs,
)
from posttrain.losses.iw_opd import add_tail_bucket as _add_tail_bucket
from posttrain.losses.iw_opd import jsd_terms as _jsd_divergence

__all__ = [
    "ServerDistillationConfig",
    "ServerDistillationTrainer",
    "_add_tail_bucket",
    "_jsd_divergence",
    "build_teacher_request_inputs",
]
