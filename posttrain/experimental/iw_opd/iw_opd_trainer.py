"""TRL's `trl.experimental.iw_opd.iw_opd_trainer` path, with the helpers TRL's module defines under private names:
the tail bucket and per-element generalized JSD of posttrain.losses.iw_opd, and the batch-repeating loader of
posttrain.data.samplers."""

from posttrain.data.samplers import RepeatBatchLoader as _RepeatBatchDataLoader
from posttrain.experimental.iw_opd import IWOPDConfig, IWOPDTrainer
from posttrain.experimental.server_distillation import build_teacher_request_inputs
from posttrain.losses.iw_opd import add_tail_bucket as _add_tail_bucket
from posttrain.losses.iw_opd import jsd_terms as _jsd_divergence

__all__ = [
    "IWOPDConfig",
    "IWOPDTrainer",
    "_RepeatBatchDataLoader",
    "_add_tail_bucket",
    "_jsd_divergence",
    "build_teacher_request_inputs",
]
