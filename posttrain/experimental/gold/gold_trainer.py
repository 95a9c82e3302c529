"""TRL's `trl.experimental.gold.gold_trainer` path."""

from posttrain.experimental.gold import GOLDConfig, GOLDTrainer
from posttrain.experimental.gold.uld import ULDLoss, build_teacher_inputs_from_texts

__all__ = ["GOLDConfig", "GOLDTrainer", "ULDLoss", "build_teacher_inputs_from_texts"]
