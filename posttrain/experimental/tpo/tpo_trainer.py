"""TRL's `trl.experimental.tpo.tpo_trainer` path: the trainer, its config and its collator under TRL's name."""

from posttrain.experimental.tpo import TPOConfig, TPOTrainer
from posttrain.experimental.tpo import TriplePreferenceCollator as DataCollatorForTriplePreference

__all__ = ["DataCollatorForTriplePreference", "TPOConfig", "TPOTrainer"]
