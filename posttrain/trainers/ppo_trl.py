"""The last TRL PPOTrainer's way of being called (trl.experimental.ppo): its keywords checked, and its dataset
format (prompt token ids in 'input_ids') read."""

from __future__ import annotations

from datasets import Dataset
from transformers import DataCollatorWithPadding, TrainingArguments

from posttrain.errors import ConfigError
from posttrain.online.rollout import PROMPT_COLUMN, PROMPT_IDS_COLUMN


def trl_reward_model(model, reward_funcs, reward_model, ref_model, data_collator):
    """reward_funcs from the last TRL PPOTrainer's keywords, checked."""
    if isinstance(model, TrainingArguments):
        raise ConfigError(
            "PPOTrainer's first argument is the model; the last TRL PPOTrainer took args first. Pass "
            "the TRL arguments by keyword: PPOTrainer(args=..., processing_class=..., model=..., "
            "ref_model=..., reward_model=..., train_dataset=..., value_model=...)."
        )
    if model is None:
        raise ConfigError("PPOTrainer needs model=... (the policy: a model, hub id or path).")
    if ref_model is not None and ref_model is model:
        raise ConfigError(
            "ref_model is the policy itself, so the KL to it would always be 0. Pass a separate copy, "
            "or ref_model=None (a frozen copy is made; with PEFT the adapter-disabled base is used)."
        )
    if reward_model is not None and reward_funcs is not None:
        raise ConfigError(
            "reward_model and reward_funcs are the same argument (TRL's and posttrain's name); pass only one."
        )
    if data_collator is not None and not isinstance(data_collator, DataCollatorWithPadding):
        raise ConfigError(
            f"data_collator={type(data_collator).__name__}: posttrain batches and pads the prompts "
            "itself (as TRL's default DataCollatorWithPadding did); drop data_collator."
        )
    return reward_funcs if reward_model is None else reward_model


def is_token_id_format(dataset) -> bool:
    return isinstance(dataset, Dataset) and "input_ids" in dataset.column_names and "prompt" not in dataset.column_names


def with_prompt_text(dataset, tokenizer):
    """A dataset in TRL's PPO format (prompt token ids in 'input_ids') with those ids as 'prompt_ids' and their
    text as 'prompt' (for reward functions and logs); other datasets unchanged."""
    if not is_token_id_format(dataset):
        return dataset
    dataset = dataset.map(
        lambda row: {
            PROMPT_COLUMN: tokenizer.decode(row["input_ids"], skip_special_tokens=True),
            PROMPT_IDS_COLUMN: list(row["input_ids"]),
        },
        desc="Reading the token ids of TRL's PPO format",
    )
    return dataset.remove_columns(
        [c for c in ("input_ids", "attention_mask", "token_type_ids", "lengths") if c in dataset.column_names]
    )
