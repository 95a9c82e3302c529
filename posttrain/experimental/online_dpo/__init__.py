"""TRL's `trl.experimental.online_dpo` path: re-exports of its config and trainer modules."""

from posttrain.experimental.online_dpo.online_dpo_config import OnlineDPOConfig
from posttrain.experimental.online_dpo.online_dpo_trainer import OnlineDPOTrainer

__all__ = ["OnlineDPOConfig", "OnlineDPOTrainer"]
