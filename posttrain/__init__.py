"""posttrain: post-training for language models on the Hugging Face stack.

`from posttrain import SFTTrainer, SFTConfig` and friends; names are imported on first use so that
`import posttrain` (and the command line's `--version`) stays fast.
"""

from importlib import import_module

__version__ = "0.1.0"

_EXPORTS = {
    "SFTTrainer": "posttrain.trainers.sft",
    "SFTConfig": "posttrain.trainers.sft",
    "RewardTrainer": "posttrain.trainers.reward",
    "RewardConfig": "posttrain.trainers.reward",
    "DPOTrainer": "posttrain.trainers.dpo",
    "DPOConfig": "posttrain.trainers.dpo",
    "SyncRefModelCallback": "posttrain.callbacks",
    "create_reference_model": "posttrain.models.reference",
    "PreferenceCollator": "posttrain.data.preference",
    "KTOTrainer": "posttrain.trainers.kto",
    "KTOConfig": "posttrain.trainers.kto",
    "GRPOTrainer": "posttrain.trainers.grpo",
    "GRPOConfig": "posttrain.trainers.grpo",
    "RLOOTrainer": "posttrain.trainers.rloo",
    "RLOOConfig": "posttrain.trainers.rloo",
    "PPOTrainer": "posttrain.trainers.ppo",
    "PPOConfig": "posttrain.trainers.ppo",
    "AutoModelForCausalLMWithValueHead": "posttrain.models.value_head",
    "apply_chat_template": "posttrain.data",
    "maybe_apply_chat_template": "posttrain.data",
    "is_conversational": "posttrain.data",
    "extract_prompt": "posttrain.data",
    "unpair_preference_dataset": "posttrain.data",
    "pack_dataset": "posttrain.data",
    "convert_sharegpt": "posttrain.data",
    "LanguageModelingCollator": "posttrain.data",
    "DistillationTrainer": "posttrain.trainers.distillation",
    "DistillationConfig": "posttrain.trainers.distillation",
}

__all__ = sorted(_EXPORTS) + ["__version__"]


def __getattr__(name):
    if name in _EXPORTS:
        return getattr(import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'posttrain' has no attribute {name!r}")
