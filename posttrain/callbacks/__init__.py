"""Trainer callbacks, one file each: TR-DPO reference sync, BEMA weight averaging, completion logging
(local JSONL / wandb, Weave) and a rich progress display."""

from .bema import BEMACallback
from .log_completions import LogCompletionsCallback
from .rich_progress import RichProgressCallback
from .sync_ref import SyncRefModelCallback, mix_into_reference
from .weave import WeaveCallback

__all__ = ["BEMACallback", "LogCompletionsCallback", "RichProgressCallback", "SyncRefModelCallback",
           "WeaveCallback", "mix_into_reference"]
