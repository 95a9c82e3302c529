"""TRL's `trl.experimental.nash_md` path: re-exports of its config and trainer modules."""

from posttrain.experimental.nash_md.nash_md_config import NashMDConfig
from posttrain.experimental.nash_md.nash_md_trainer import NashMDTrainer, sample_completions

__all__ = ["NashMDConfig", "NashMDTrainer", "sample_completions"]
