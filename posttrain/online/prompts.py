"""The prompts of the online trainers' datasets: checked for a 'prompt' column and tokenized once, with the chat
template and its generation prompt for conversations."""

from __future__ import annotations

from posttrain.data.chat import apply_chat_template
from posttrain.data.formats import is_message_list
from posttrain.data.report import cut_column
from posttrain.errors import DataError
from posttrain.online.rollout import PROMPT_COLUMN, PROMPT_IDS_COLUMN

__all__ = ["require_prompt_column", "tokenize_prompt"]


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


def require_prompt_column(dataset, name: str) -> None:
    if PROMPT_COLUMN not in dataset.column_names:
        raise DataError(
            f"{name} needs a 'prompt' column (strings or lists of messages) but has the columns "
            f"{dataset.column_names}; rename the column holding the prompts, e.g. "
            "dataset.rename_column('question', 'prompt')."
        )
    if len(dataset) == 0:
        raise DataError(f"{name} is empty; pass at least one prompt.")
