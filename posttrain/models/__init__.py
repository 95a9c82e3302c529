"""Model loading (by id, path or object), the built-in SmolLM2-135M-Instruct, tiny test models; at TRL's
`trl.models` path, its helpers (reference models, unwrapping for generation, frozen-model placement, activation
offloading and selective checkpointing)."""

from posttrain.models import activation_offloading, selective_activation_checkpointing, utils
from posttrain.models.activation_offloading import get_act_offloading_ctx_manager
from posttrain.models.builtin import BUILTIN_MODEL_ID, builtin_model_path
from posttrain.models.frozen import prepare_deepspeed, prepare_fsdp
from posttrain.models.loading import load_causal_lm, load_sequence_classifier, load_tokenizer, resolve_model_path
from posttrain.models.reference import create_reference_model
from posttrain.models.selective_activation_checkpointing import enable_selective_activation_checkpointing
from posttrain.models.utils import unwrap_model_for_generation

__all__ = [
    "BUILTIN_MODEL_ID",
    "activation_offloading",
    "create_reference_model",
    "enable_selective_activation_checkpointing",
    "get_act_offloading_ctx_manager",
    "prepare_deepspeed",
    "prepare_fsdp",
    "selective_activation_checkpointing",
    "unwrap_model_for_generation",
    "utils",
    "builtin_model_path",
    "load_causal_lm",
    "load_sequence_classifier",
    "load_tokenizer",
    "resolve_model_path",
]
