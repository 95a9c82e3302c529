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
from posttrain.data.trl_vision_collators import DataCollatorForVisionLanguageChatML
from posttrain.experimental.former_helpers import (
    DPODataCollatorWithPadding,
    add_bos_token_if_needed,
    add_eos_token_if_needed,
    enable_gradient_checkpointing,
    get_reward,
    peft_module_casting_to_bf16,
    prepare_model_for_kbit_training,
    prepare_peft_model,
)
from posttrain.models.reference import create_reference_model
from posttrain.runtime.device_cache import empty_cache

__all__ = [
    "DPODataCollatorWithPadding",
    "DataCollatorForVisionLanguageChatML",
    "add_bos_token_if_needed",
    "add_eos_token_if_needed",
    "enable_gradient_checkpointing",
    "get_reward",
    "peft_module_casting_to_bf16",
    "prepare_model_for_kbit_training",
    "prepare_peft_model",
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
