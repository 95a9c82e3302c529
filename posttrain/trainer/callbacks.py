"""TRL's `trl.trainer.callbacks` import path; the callbacks live in `posttrain.callbacks`."""

from posttrain.callbacks import (
    BEMACallback,
    LogCompletionsCallback,
    RichProgressCallback,
    SyncRefModelCallback,
    WeaveCallback,
)

__all__ = ["BEMACallback", "LogCompletionsCallback", "RichProgressCallback", "SyncRefModelCallback", "WeaveCallback"]
