"""Dataset formats: detect which one a dataset is in and validate it before any training.

A format is a set of columns (as in TRL's conventions). Each comes in a *standard* form (strings)
and a *conversational* form (lists of ``{"role", "content"}`` messages):

=======================  ======================================  ===========================
format                   columns                                 used by
=======================  ======================================  ===========================
language_modeling        ``text`` or ``messages``                SFT
prompt_only              ``prompt``                              GRPO, RLOO, PPO
prompt_completion        ``prompt``, ``completion``              SFT
preference               [``prompt``], ``chosen``, ``rejected``  Reward, DPO (KTO unpairs it)
unpaired_preference      ``prompt``, ``completion``, ``label``   KTO
stepwise_supervision     ``prompt``, ``completions``, ``labels`` process reward models
=======================  ======================================  ===========================
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from posttrain.errors import DataError

ROLES = ("system", "user", "assistant", "tool")

# Most specific first: the first format whose required columns are all present wins.
FORMAT_COLUMNS: dict[str, tuple[str, ...]] = {
    "stepwise_supervision": ("prompt", "completions", "labels"),
    "unpaired_preference": ("prompt", "completion", "label"),
    "preference": ("chosen", "rejected"),
    "prompt_completion": ("prompt", "completion"),
    "language_modeling": ("messages",),
    "language_modeling_text": ("text",),
    "prompt_only": ("prompt",),
}
# Columns that hold text or conversations (the others, e.g. `label`, hold metadata).
TEXT_COLUMNS = ("text", "messages", "prompt", "completion", "chosen", "rejected", "completions")


@dataclass(frozen=True)
class DatasetFormat:
    kind: str  # a key of FORMAT_COLUMNS, with "language_modeling_text" folded into "language_modeling"
    conversational: bool
    columns: tuple[str, ...]  # the columns that carry the format, in order

    @property
    def has_explicit_prompt(self) -> bool:
        return "prompt" in self.columns


def _describe_formats() -> str:
    rows = {
        "language modeling": "text | messages",
        "prompt-only": "prompt",
        "prompt-completion": "prompt, completion",
        "preference": "[prompt], chosen, rejected",
        "unpaired preference": "prompt, completion, label",
        "stepwise supervision": "prompt, completions, labels",
    }
    return "; ".join(f"{name}: ({cols})" for name, cols in rows.items())


def is_message_list(value: Any) -> bool:
    """True for a list of dicts that look like chat messages (role/content or ShareGPT from/value)."""
    return (
        isinstance(value, list)
        and len(value) > 0
        and all(isinstance(m, dict) for m in value)
        and all(("role" in m) or ("from" in m) for m in value)
    )


CONVERSATION_KEYS = ("prompt", "chosen", "rejected", "completion", "messages")


def is_conversational(example: dict) -> bool:
    """Tells whether a dataset row is in conversational form (message lists) or standard form (strings).

    True if `example` is in conversational form: its first column among prompt / chosen / rejected /
    completion / messages holds a list whose first item is a message with a ``role`` (TRL's rule; ShareGPT
    ``from``/``value`` rows are not conversational until converted, see `maybe_convert_to_chatml`).

    See docs/dataset_formats.md.
    """
    for key in CONVERSATION_KEYS:
        if key in example:
            value = example[key]
            return isinstance(value, list) and len(value) > 0 and isinstance(value[0], dict) and "role" in value[0]
    return False


def detect_format(columns: Iterable[str], example: dict | None = None) -> DatasetFormat:
    """The dataset format implied by `columns` (and, with `example`, whether it is conversational)."""
    columns = list(columns)
    for kind, required in FORMAT_COLUMNS.items():
        if all(c in columns for c in required):
            with_prompt = ("prompt",) if kind == "preference" and "prompt" in columns else ()
            used = tuple(dict.fromkeys(c for c in (*with_prompt, *required) if c in TEXT_COLUMNS))
            conversational = bool(example) and any(is_message_list(example.get(c)) for c in used)
            kind = "language_modeling" if kind == "language_modeling_text" else kind
            return DatasetFormat(kind, conversational, used)
    raise DataError(
        f"No known dataset format matches the columns {columns}. posttrain reads these formats (columns): "
        f"{_describe_formats()}. Rename your columns to one of them, e.g. dataset.rename_column('question', 'prompt')."
        + _hint_for_messages_elsewhere(columns, example)
    )


def _hint_for_messages_elsewhere(columns: list[str], example: dict | None) -> str:
    if not example:
        return ""
    for col in columns:
        if is_message_list(example.get(col)):
            return (
                f" Column '{col}' holds a conversation: rename it to 'messages' "
                f"(dataset.rename_column('{col}', 'messages'))."
            )
    return ""


def _check_messages(messages: Any, column: str, row: int) -> None:
    if not isinstance(messages, list) or not messages:
        raise DataError(f"Row {row}, column '{column}': expected a non-empty list of messages, got {messages!r:.80}.")
    for j, message in enumerate(messages):
        if not isinstance(message, dict) or "role" not in message:
            raise DataError(
                f"Row {row}, column '{column}', message {j}: a message needs a 'role' and a 'content' key, "
                f"got {message!r:.80}."
            )
        if message["role"] not in ROLES:
            raise DataError(
                f"Row {row}, column '{column}', message {j}: role '{message['role']}' is not one of {ROLES}. "
                "Map it to one of these roles before training."
            )
        if "content" not in message or message["content"] is None:
            raise DataError(
                f"Row {row}, column '{column}', message {j} (role '{message['role']}') has no 'content'. "
                "Every message needs a 'content' string."
            )


def check_example(example: dict, fmt: DatasetFormat, row: int) -> None:
    """Raises DataError naming the row and column if `example` does not fit `fmt`."""
    for column in fmt.columns:
        value = example.get(column)
        if column == "completions":
            values = value if isinstance(value, list) else [value]
        else:
            values = [value]
        for v in values:
            if fmt.conversational:
                if isinstance(v, str):
                    raise DataError(
                        f"Row {row}: column '{column}' is a string but the other columns are conversations "
                        "(lists of messages). Use one form for all columns: either all strings or all lists of "
                        "{'role', 'content'} messages."
                    )
                _check_messages(v, column, row)
            elif not isinstance(v, str):
                if is_message_list(v):
                    raise DataError(
                        f"Row {row}: column '{column}' is a conversation but other columns are strings. "
                        "Use one form for all columns: either all strings or all lists of messages."
                    )
                raise DataError(f"Row {row}, column '{column}': expected a string, got {type(v).__name__}.")
    if fmt.kind == "unpaired_preference" and not isinstance(example.get("label"), bool):
        label = example.get("label")
        raise DataError(
            f"Row {row}, column 'label': expected a boolean (True = desirable), got {label!r} "
            f"({type(label).__name__}). Convert it, e.g. dataset.map(lambda x: {{'label': x['label'] == 'good'}})."
        )


def validate_dataset(dataset, accepted: Iterable[str], trainer: str, name: str = "train_dataset") -> DatasetFormat:
    """Detects the format of `dataset` and checks that `trainer` accepts it; checks the first row's types.

    Per-row checks happen during tokenization (`check_example`), where every row is visited anyway.
    """
    accepted = tuple(accepted)
    if dataset is None or len(dataset) == 0:
        raise DataError(f"{trainer}: {name} is empty. Pass a dataset with at least one row.")
    first = dataset[0]
    fmt = detect_format(dataset.column_names, first)
    if fmt.kind not in accepted:
        readable = ", ".join(k.replace("_", "-") for k in accepted)
        needed = {k: FORMAT_COLUMNS[k] for k in accepted}
        raise DataError(
            f"{trainer} does not train on {fmt.kind.replace('_', '-')} data (columns found: {dataset.column_names}). "
            f"It accepts: {readable}, i.e. columns {needed}."
        )
    check_example(first, fmt, row=0)
    return fmt
