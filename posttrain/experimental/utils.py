"""TRL's `trl.experimental.utils` path: the data helpers its experimental trainers and users import from there."""

from posttrain.data.byte_offsets import encode_with_byte_offsets, pad_byte_offsets
from posttrain.data.chatml import DataCollatorForChatML, truncate_dataset

__all__ = ["DataCollatorForChatML", "encode_with_byte_offsets", "pad_byte_offsets", "truncate_dataset"]
