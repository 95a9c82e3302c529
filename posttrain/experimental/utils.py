"""TRL's `trl.experimental.utils` path: the data helpers its experimental trainers and users import from there."""

from posttrain.data.byte_offsets import encode_with_byte_offsets, pad_byte_offsets
from posttrain.data.chatml import DataCollatorForChatML, truncate_dataset
from posttrain.data.sequence_tensors import (
    first_true_indices,
    is_byte_level_tokenizer,
    pad_to_length,
    piece_byte_len,
    truncate_right,
)
from posttrain.models.reference import create_reference_model
from posttrain.runtime.device_cache import empty_cache

__all__ = [
    "DataCollatorForChatML",
    "create_reference_model",
    "empty_cache",
    "encode_with_byte_offsets",
    "first_true_indices",
    "is_byte_level_tokenizer",
    "pad_byte_offsets",
    "pad_to_length",
    "piece_byte_len",
    "truncate_dataset",
    "truncate_right",
]
