"""posttrain: post-training for language models on the Hugging Face stack.

`from posttrain import SFTTrainer, SFTConfig` and friends; names are imported on first use so that
`import posttrain` (and the command line's `--version`) stays fast.
"""

from importlib import import_module

from posttrain.version import __version__

_EXPORTS = {
    "SFTTrainer": "posttrain.trainers.sft",
    "SFTConfig": "posttrain.trainers.sft",
    "RewardTrainer": "posttrain.trainers.reward",
    "RewardConfig": "posttrain.trainers.reward",
    "DPOTrainer": "posttrain.trainers.dpo",
    "DPOConfig": "posttrain.trainers.dpo",
    "SyncRefModelCallback": "posttrain.callbacks",
    "BEMACallback": "posttrain.callbacks",
    "LogCompletionsCallback": "posttrain.callbacks",
    "RichProgressCallback": "posttrain.callbacks",
    "WeaveCallback": "posttrain.callbacks",
    "add_response_schema": "posttrain.data.chat_templates",
    "clone_chat_template": "posttrain.data.chat_templates",
    "get_training_chat_template": "posttrain.data.chat_templates",
    "supports_tool_calling": "posttrain.data.chat_templates",
    "is_conversational_from_value": "posttrain.data_utils",
    "maybe_convert_to_chatml": "posttrain.data_utils",
    "maybe_extract_prompt": "posttrain.data_utils",
    "maybe_unpair_preference_dataset": "posttrain.data_utils",
    "prepare_multimodal_messages": "posttrain.data_utils",
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
    "TrlParser": "posttrain.compat",
    "ScriptArguments": "posttrain.compat",
    "ModelConfig": "posttrain.compat",
    "DatasetMixtureConfig": "posttrain.compat",
    "get_dataset": "posttrain.compat",
    "get_peft_config": "posttrain.compat",
    "get_quantization_config": "posttrain.compat",
    "init_zero_verbose": "posttrain.compat",
}

__all__ = sorted(_EXPORTS) + ["__version__"]


def __getattr__(name):
    if name in _EXPORTS:
        return getattr(import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'posttrain' has no attribute {name!r}")
