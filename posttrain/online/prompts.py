"""The prompts of the online trainers' datasets: checked for a 'prompt' column and tokenized once, with the chat
template and its generation prompt for conversations."""

from __future__ import annotations

from posttrain.data.chat import apply_chat_template
from posttrain.data.formats import is_message_list
from posttrain.data.report import cut_column
from posttrain.errors import ConfigError, DataError
from posttrain.online.rollout import PROMPT_COLUMN, PROMPT_IDS_COLUMN
from posttrain.training.streaming import is_streaming

__all__ = ["column_names", "refuse_stream_lookahead", "require_prompt_column", "tokenize_prompt"]


def tokenize_prompt(
    example: dict,
    row: int,
    tokenizer,
    conversational: bool,
    max_prompt_length: int | None,
    chat_template_kwargs: dict | None = None,
):
    prompt = example[PROMPT_COLUMN]
    if conversational != is_message_list(prompt) or not (conversational or isinstance(prompt, str)):
        expected = "a non-empty list of {'role', 'content'} messages" if conversational else "a string"
        raise DataError(
            f"Row {row}, column 'prompt': expected {expected} like row 0, got {prompt!r:.80}. Fix or drop that row."
        )
    if conversational:
        text = apply_chat_template({PROMPT_COLUMN: prompt}, tokenizer, **(chat_template_kwargs or {}))[PROMPT_COLUMN]
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    else:
        ids = tokenizer(prompt)["input_ids"]
    if not ids:
        raise DataError(
            f"Row {row}: the prompt is empty after tokenization; generation needs at least one prompt "
            "token. Remove the row or give it a prompt."
        )
    cut = 0 if max_prompt_length is None else max(len(ids) - max_prompt_length, 0)
    return {PROMPT_IDS_COLUMN: ids[cut:], cut_column("max_prompt_length"): cut}


def column_names(dataset) -> list[str]:
    """The dataset's columns (a stream without declared features shows them in its first row)."""
    if dataset.column_names is not None:
        return list(dataset.column_names)
    return list(next(iter(dataset), {}))


def require_prompt_column(dataset, name: str) -> None:
    columns = column_names(dataset)
    if PROMPT_COLUMN not in columns:
        raise DataError(
            f"{name} needs a 'prompt' column (strings or lists of messages) but has the columns "
            f"{columns}; rename the column holding the prompts, e.g. "
            "dataset.rename_column('question', 'prompt')."
        )
    if (next(iter(dataset), None) is None) if is_streaming(dataset) else len(dataset) == 0:
        raise DataError(f"{name} is empty; pass at least one prompt.")


def refuse_stream_lookahead(args) -> None:
    """Settings that read prompts out of order, which a stream cannot give."""
    reasons = {
        "async_generation_rounds": "rounds generated ahead look their prompts up by index",
        "dynamic_sampling": "extra batches are drawn at random from the training set",
    }
    for name, reason in reasons.items():
        if getattr(args, name, None):
            raise ConfigError(
                f"{name}={getattr(args, name)!r} does not work with a streaming train_dataset (IterableDataset): "
                f"{reason}. Turn it off, or load the dataset without streaming."
            )
