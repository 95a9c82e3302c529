"""TRL's `trl.experimental.a2po` path: re-exports of its config and trainer modules."""

from posttrain.experimental.a2po.a2po_config import A2POConfig
from posttrain.experimental.a2po.a2po_trainer import A2POTrainer

__all__ = ["A2POConfig", "A2POTrainer"]
