"""Trainer callbacks, one file each: TR-DPO reference sync, BEMA weight averaging, completion logging
(local JSONL / wandb, Weave), a rich progress display, win rate against the reference (a judge), and merging the
policy with its base checkpoint."""

from .bema import BEMACallback
from .log_completions import LogCompletionsCallback
from .merge_model import MergeConfig, MergeModelCallback
from .rich_progress import RichProgressCallback
from .sync_ref import SyncRefModelCallback, mix_into_reference
from .weave import WeaveCallback
from .win_rate import WinRateCallback

__all__ = [
    "BEMACallback",
    "LogCompletionsCallback",
    "MergeConfig",
    "MergeModelCallback",
    "RichProgressCallback",
    "SyncRefModelCallback",
    "WeaveCallback",
    "WinRateCallback",
    "mix_into_reference",
]
