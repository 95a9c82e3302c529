"""TRL's `trl.experimental.utils` path: the data helpers its experimental trainers and users import from there."""

from posttrain.data.chatml import DataCollatorForChatML, truncate_dataset

__all__ = ["DataCollatorForChatML", "truncate_dataset"]
