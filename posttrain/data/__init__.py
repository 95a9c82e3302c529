"""The offline data path: formats -> chat rendering -> tokenization with masks -> packing -> collation."""

from posttrain.data.chat import apply_chat_template, convert_sharegpt, maybe_apply_chat_template
from posttrain.data.collators import IGNORE_INDEX, LanguageModelingCollator
from posttrain.data.formats import DatasetFormat, detect_format, is_conversational, validate_dataset
from posttrain.data.packing import pack_dataset
from posttrain.data.tokenize import tokenize_example

# TRL's versions; the trainers' own (same names) are in .chat
from posttrain.data.transforms import extract_prompt, unpair_preference_dataset

__all__ = [
    "IGNORE_INDEX",
    "DatasetFormat",
    "LanguageModelingCollator",
    "apply_chat_template",
    "convert_sharegpt",
    "detect_format",
    "extract_prompt",
    "is_conversational",
    "maybe_apply_chat_template",
    "pack_dataset",
    "tokenize_example",
    "unpair_preference_dataset",
    "validate_dataset",
]
