"""TRL's import path `trl.experimental.winrate_callback`; the callback lives in posttrain.callbacks.win_rate."""

from posttrain.callbacks.win_rate import WinRateCallback

__all__ = ["WinRateCallback"]
