"""TRL's `trl.experimental.sdpo.teacher_sync` path: the callback that keeps an averaged-adapter teacher."""

from posttrain.callbacks.adapter_ema import PEFTAdapterEMACallback

__all__ = ["PEFTAdapterEMACallback"]
