"""TRL's `trl.data_utils` functions, same names, signatures and behaviour; the code lives in posttrain's
data layer (`posttrain/data/`)."""

from posttrain.data.chat import apply_chat_template, maybe_apply_chat_template
from posttrain.data.formats import is_conversational
from posttrain.data.packing import pack_dataset
from posttrain.data.transforms import (
    common_prefix_length,
    extract_prompt,
    get_dataset_column_names,
    is_conversational_from_value,
    maybe_convert_to_chatml,
    maybe_extract_prompt,
    maybe_unpair_preference_dataset,
    prepare_multimodal_messages,
    unpair_preference_dataset,
)

__all__ = [
    "apply_chat_template",
    "common_prefix_length",
    "extract_prompt",
    "get_dataset_column_names",
    "is_conversational",
    "is_conversational_from_value",
    "maybe_apply_chat_template",
    "maybe_convert_to_chatml",
    "maybe_extract_prompt",
    "maybe_unpair_preference_dataset",
    "pack_dataset",
    "prepare_multimodal_messages",
    "unpair_preference_dataset",
]
