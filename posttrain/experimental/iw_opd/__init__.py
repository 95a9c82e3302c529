"""TRL's `trl.experimental.iw_opd` path: re-exports of its config and trainer modules."""

from posttrain.experimental.iw_opd.iw_opd_config import IWOPDConfig
from posttrain.experimental.iw_opd.iw_opd_trainer import IWOPDTrainer, build_teacher_request_inputs

__all__ = ["IWOPDConfig", "IWOPDTrainer", "build_teacher_request_inputs"]
