"""The offline data path: formats -> chat rendering -> tokenization with masks -> packing -> collation."""

from .chat import apply_chat_template, convert_sharegpt, maybe_apply_chat_template
from .collators import IGNORE_INDEX, LanguageModelingCollator
from .formats import DatasetFormat, detect_format, is_conversational, validate_dataset
from .packing import pack_dataset
from .tokenize import tokenize_example

# TRL's versions; the trainers' own (same names) are in .chat
from .transforms import extract_prompt, unpair_preference_dataset

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
