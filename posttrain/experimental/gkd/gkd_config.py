"""TRL's `trl.experimental.gkd.gkd_config` path: GKDConfig, Generalized Knowledge Distillation's settings."""

from __future__ import annotations

from dataclasses import dataclass

from posttrain.trainers.distillation import DistillationConfig
from posttrain.training.fields import config_field, disable_dropout_field, learning_rate_field


@dataclass
class GKDConfig(DistillationConfig):
    remove_unused_columns: bool = config_field(
        True, "TRL's default; the trainer sets it to False (every column reaches the collator), as TRL's does."
    )
    learning_rate: float = learning_rate_field(2e-5)
    temperature: float = config_field(
        0.9,
        "Sampling temperature of the student's (and with seq_kd the teacher's) completions; the loss compares "
        "the untempered distributions.",
    )
    lmbda: float = config_field(
        0.5, "Probability that a micro-batch's completions are sampled by the student (the on-policy fraction)."
    )
    beta: float = config_field(
        0.5,
        "Generalized JSD interpolation: 0 = forward KL(teacher‖student), 0.5 = Jensen-Shannon, 1 = reverse "
        "KL(student‖teacher).",
    )
    max_new_tokens: int = config_field(128, "Most tokens sampled per completion (sets max_completion_length).", min=1)
    disable_dropout: bool = disable_dropout_field(True, "Switch off dropout in the student.")
    seq_kd: bool = config_field(
        False,
        "Sequence-level KD: micro-batches that are not on-policy train on completions the teacher samples "
        "instead of the data's.",
    )
    shuffle_dataset: bool = config_field(
        False, "Shuffle the prepared dataset once with `seed` (batches are drawn in random order either way)."
    )

    def __post_init__(self):
        self.max_completion_length = self.max_new_tokens
        super().__post_init__()
