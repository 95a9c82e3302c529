"""`KTOConfig`: the settings of KTO, with TRL's field names, order, defaults and help."""

from __future__ import annotations

from dataclasses import dataclass

from posttrain.errors import ConfigError
from posttrain.losses.preference import KTO_LOSS_TYPES
from posttrain.training.fields import config_field, max_length_field, remove_unused_columns_field
from posttrain.training.reference_trainer import ReferenceConfig


@dataclass
class KTOConfig(ReferenceConfig):
    """Settings of `KTOTrainer`: TRL's KTO fields and defaults (beta, class weights, loss type) on top of transformers'
    `TrainingArguments`.

    See docs/trainers/kto.md.
    """

    remove_unused_columns: bool = remove_unused_columns_field()  # TRL's default

    train_sampling_strategy: str = config_field(
        "sequential",
        "Order of the training rows; loss_type 'kto' needs 'sequential' (its mismatched KL pairs are fixed "
        "per batch in the dataset).",
    )
    max_length: int | None = max_length_field(
        1024, "Truncate prompt + completion to this many tokens (the completion is cut)."
    )
    beta: float = config_field(
        0.1,
        "Scale of the implicit reward beta * log(pi/pi_ref); higher keeps the policy closer to the reference.",
        gt=0,
    )
    desirable_weight: float = config_field(
        1.0, "Weight of desirable examples' losses (to balance unequal class counts).", gt=0
    )
    undesirable_weight: float = config_field(
        1.0, "Weight of undesirable examples' losses (to balance unequal class counts).", gt=0
    )
    loss_type: str = config_field("kto", "'kto' (with the KL reference point) or 'apo_zero_unpaired' (without one).")

    def __post_init__(self):
        if self.loss_type not in KTO_LOSS_TYPES:
            raise ConfigError(f"loss_type={self.loss_type!r} is not supported; choose from {list(KTO_LOSS_TYPES)}.")
        strategy = getattr(self.train_sampling_strategy, "value", self.train_sampling_strategy)
        if self.loss_type == "kto" and strategy != "sequential":
            raise ConfigError(
                f"train_sampling_strategy={strategy!r}: loss_type 'kto' pairs each prompt with a neighbour's "
                "completion inside its batch, fixed in the dataset, so the rows must come in order; set "
                "train_sampling_strategy='sequential' (the default) or use loss_type='apo_zero_unpaired'."
            )
        if self.loss_type == "kto" and self.per_device_train_batch_size < 2:
            raise ConfigError(
                f"per_device_train_batch_size={self.per_device_train_batch_size}: the KL reference point pairs each "
                "prompt with another example's completion from the same batch, and a batch of one has none; set "
                "per_device_train_batch_size to 2 or more."
            )
        super().__post_init__()
