"""TRL's import path `trl.experimental.merge_model_callback`; the callback lives in posttrain.callbacks.merge_model."""

from posttrain.callbacks.merge_model import (
    MergeConfig,
    MergeModelCallback,
    linear_merge,
    merge_model_weights,
    slerp,
    upload_model_to_hf,
)

__all__ = ["MergeConfig", "MergeModelCallback", "linear_merge", "merge_model_weights", "slerp", "upload_model_to_hf"]
