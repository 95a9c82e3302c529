"""TRL's `trl.experimental.tpo` path: re-exports of its config and trainer modules."""

from posttrain.experimental.tpo.tpo_config import TPOConfig
from posttrain.experimental.tpo.tpo_trainer import DataCollatorForTriplePreference, TPOTrainer, TriplePreferenceCollator

__all__ = ["DataCollatorForTriplePreference", "TPOConfig", "TPOTrainer", "TriplePreferenceCollator"]
