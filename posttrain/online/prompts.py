"""The prompts of the online trainers' datasets: checked for a 'prompt' column and tokenized once, with the chat
template and its generation prompt for conversations."""

from __future__ import annotations

from posttrain.data.chat import apply_chat_template
from posttrain.data.formats import is_message_list
from posttrain.data.report import cut_column
from posttrain.errors import ConfigError, DataError
from posttrain.online.rollout import PROMPT_COLUMN, PROMPT_IDS_COLUMN
from posttrain.training.streaming import is_streaming

__all__ = ["column_names", "model_context", "refuse_stream_lookahead", "require_prompt_column", "tokenize_prompt"]


def model_context(model, trust_remote_code: bool = False) -> int | None:
    """The model's context in tokens (its config's max_position_embeddings, a vision-language model's text
    config's), from a loaded model or a model id; None where the config does not say."""
    if isinstance(model, str):
        from transformers import AutoConfig

        try:
            config = AutoConfig.from_pretrained(model, trust_remote_code=trust_remote_code)
        except (OSError, ValueError):  # loading the model itself says what is wrong
            return None
    else:
        config = getattr(model, "config", None)
    config = getattr(config, "text_config", None) or config
    context = getattr(config, "max_position_embeddings", None)
    return context if isinstance(context, int) and context > 0 else None


def _check_context(row: int, length: int, context: int | None, max_prompt_length: int | None, room: int) -> None:
    """A prompt that leaves the model's context no room for a completion token stops preparation, naming the
    row and the fix (TRL trains on it silently past the trained context)."""
    if context is None or length < context:
        return
    keep = max(context - room, 1)
    fix = (
        f"lower max_prompt_length={max_prompt_length} below the context (e.g. {keep})"
        if max_prompt_length is not None
        else f"set max_prompt_length (e.g. {keep}: each prompt keeps its last tokens, and the data report counts "
        "the rows cut)"
    )
    raise DataError(
        f"Row {row}: the prompt is {length} tokens, but the model's context is {context} tokens "
        f"(config.max_position_embeddings), so no completion token fits. {fix[0].upper()}{fix[1:]}, or drop the "
        "long rows (dataset.filter on the prompt's length)."
    )


def tokenize_prompt(
    example: dict,
    row: int,
    tokenizer,
    conversational: bool,
    max_prompt_length: int | None,
    chat_template_kwargs: dict | None = None,
    context: int | None = None,
    room: int = 1,
):
    """The prompt's token ids (its start cut to max_prompt_length, the cut counted), checked against the model's
    `context`; `room` is the completion length a suggested max_prompt_length leaves space for."""
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
    _check_context(row, len(ids) - cut, context, max_prompt_length, room)
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
