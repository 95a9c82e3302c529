"""TRL's `trl.experimental.gold` path: re-exports of its config and trainer modules."""

from posttrain.experimental.gold.gold_config import GOLDConfig
from posttrain.experimental.gold.gold_trainer import GOLDTrainer, ULDLoss, build_teacher_inputs_from_texts

__all__ = ["GOLDConfig", "GOLDTrainer", "ULDLoss", "build_teacher_inputs_from_texts"]
