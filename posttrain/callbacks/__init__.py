"""Trainer callbacks, one file each: TR-DPO reference sync, BEMA weight averaging, completion logging
(local JSONL / wandb, Weave), a rich progress display, win rate against the reference (a judge), and merging the
policy with its base checkpoint."""

from posttrain.callbacks.bema import BEMACallback
from posttrain.callbacks.log_completions import LogCompletionsCallback
from posttrain.callbacks.merge_model import MergeConfig, MergeModelCallback
from posttrain.callbacks.rich_progress import RichProgressCallback
from posttrain.callbacks.weave import WeaveCallback
from posttrain.callbacks.win_rate import WinRateCallback
from posttrain.training.sync_ref import SyncRefModelCallback, mix_into_reference

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
