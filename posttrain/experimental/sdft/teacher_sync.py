"""TRL's `trl.experimental.sdft.teacher_sync` path: the callback that keeps an averaged-adapter teacher."""

from posttrain.callbacks.adapter_ema import PEFTAdapterEMACallback
from posttrain.callbacks.teacher_sync import SyncTeacherModelCallback
from posttrain.models.utils import is_pure_lora_training

__all__ = ["PEFTAdapterEMACallback", "SyncTeacherModelCallback", "is_pure_lora_training"]
