"""Model loading (by id, path or object), the built-in SmolLM2-135M-Instruct, tiny test models."""

from posttrain.models.builtin import BUILTIN_MODEL_ID, builtin_model_path
from posttrain.models.loading import load_causal_lm, load_sequence_classifier, load_tokenizer, resolve_model_path

__all__ = [
    "BUILTIN_MODEL_ID",
    "builtin_model_path",
    "load_causal_lm",
    "load_sequence_classifier",
    "load_tokenizer",
    "resolve_model_path",
]
