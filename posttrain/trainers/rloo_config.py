"""`RLOOConfig`: the settings of RLOO, with TRL's field names, order, defaults and help."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from posttrain.errors import ConfigError
from posttrain.online.engine import OnlineConfig
from posttrain.training.fields import config_field


@dataclass
class RLOOConfig(OnlineConfig):
    """Settings of `RLOOTrainer`: GRPO's online options with RLOO's defaults and advantage options.

    OnlineConfig with RLOO's defaults: 2 generations per prompt, beta=0.05 as a KL penalty in the reward,
    loss_type "dr_grpo" (sequence-level REINFORCE), advantages not normalised.

    See docs/trainers/rloo.md.
    """

    min_num_generations: ClassVar[int] = 2
    method: ClassVar[str] = "RLOO"

    num_generations: int = config_field(2, "Completions sampled per prompt (k in the paper).")
    beta: float = config_field(
        0.05,
        "KL coefficient: beta times the completion's summed log ratio to the reference is subtracted from its reward.",
    )
    loss_type: str = config_field(
        "dr_grpo", "Loss aggregation (see OnlineConfig); dr_grpo is the paper's sequence-level estimator."
    )
    normalize_advantages: bool = config_field(
        False, "Scale the advantages of each generation batch to mean 0 and std 1."
    )
    reward_clip_range: list[float] | None = config_field(
        None,
        "[min, max]: clip each completion's (weighted) reward to this range before the KL penalty and the "
        "baseline (None: no clipping).",
    )

    def __post_init__(self):
        super().__post_init__()
        if self.reward_clip_range is not None:
            low_high = list(self.reward_clip_range)
            if len(low_high) != 2 or not low_high[0] <= low_high[1]:
                raise ConfigError(
                    f"reward_clip_range={self.reward_clip_range!r} must be two numbers [min, max] with "
                    "min <= max (None: no clipping)."
                )
            self.reward_clip_range = tuple(float(v) for v in low_high)
