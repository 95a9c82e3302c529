"""posttrain: post-training for language models on the Hugging Face stack.

`from posttrain import SFTTrainer, SFTConfig` and friends; names are imported on first use so that
`import posttrain` (and the command line's `--version`) stays fast.
"""

from importlib import import_module

__version__ = "0.1.0"

_EXPORTS = {
    "SFTTrainer": "posttrain.trainers.sft",
    "SFTConfig": "posttrain.trainers.sft",
    "apply_chat_template": "posttrain.data",
    "maybe_apply_chat_template": "posttrain.data",
    "is_conversational": "posttrain.data",
    "extract_prompt": "posttrain.data",
    "unpair_preference_dataset": "posttrain.data",
    "pack_dataset": "posttrain.data",
    "convert_sharegpt": "posttrain.data",
    "LanguageModelingCollator": "posttrain.data",
}

__all__ = sorted(_EXPORTS) + ["__version__"]


def __getattr__(name):
    if name in _EXPORTS:
        return getattr(import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'posttrain' has no attribute {name!r}")
