"""TRL's `trl.experimental.bema_for_ref_model` path: BEMA as the DPO reference (Block & Zhang 2025,
arXiv:2508.00180): re-exports of its callback and DPO trainer modules."""

from posttrain.experimental.bema_for_ref_model.callback import BEMACallback, CallbackHandlerWithRefModel
from posttrain.experimental.bema_for_ref_model.dpo_trainer import DPOTrainer

__all__ = ["BEMACallback", "CallbackHandlerWithRefModel", "DPOTrainer"]
