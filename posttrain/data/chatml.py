"""TRL's `trl.experimental.utils` data helpers: a collator that trains the last assistant turn of a conversation
(`DataCollatorForChatML`) and `truncate_dataset`, which cuts every list column of a dataset to a length."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import torch
from datasets import DatasetDict, IterableDataset, IterableDatasetDict

from posttrain.data.batches import pad


def _format_of(dataset) -> dict[str, Any]:
    """What `with_format(**format)` needs to give the dataset its current format back."""
    if isinstance(dataset, (DatasetDict, IterableDatasetDict)):
        return _format_of(next(iter(dataset.values()))) if dataset else {}
    if isinstance(dataset, IterableDataset):
        formatting = dataset._formatting
        return {"type": formatting.format_type if formatting is not None else None}
    fmt = dataset.format
    return {
        "type": fmt["type"],
        "columns": fmt["columns"],
        "output_all_columns": fmt["output_all_columns"],
        **fmt["format_kwargs"],
    }


def truncate_dataset(dataset, max_length: int, map_kwargs: dict[str, Any] | None = None):
    """Every list column (token ids, masks, ...) of `dataset` cut to its first `max_length` items; other columns and
    the dataset's format are kept. Works on a Dataset, an IterableDataset and their dicts; `map_kwargs` go to
    `dataset.map` (e.g. `num_proc`)."""
    if max_length < 0:
        raise ValueError(f"truncate_dataset: max_length must be >= 0, got {max_length}.")

    def cut(table: pa.Table) -> pa.Table:
        columns = [
            pc.list_slice(col, 0, max_length) if pa.types.is_list(col.type) or pa.types.is_large_list(col.type) else col
            for col in table.columns
        ]
        return pa.Table.from_arrays(columns, names=table.column_names)

    fmt = _format_of(dataset)
    out = dataset.with_format("arrow").map(cut, batched=True, **(map_kwargs or {}))
    return out.with_format(**fmt)


@dataclass
class DataCollatorForChatML:
    """Batches conversations (`messages_key` rows) for training on the last message: `input_ids` is the whole
    conversation rendered with the chat template, `prompts` the conversation before its last message with the
    generation prompt, `labels` the ids with `ignore_index` on the prompt. Rows already tokenized (`input_ids`, and
    optionally `completion_mask` marking the trained tokens) are taken as they are. Over `max_length` tokens, the
    oldest are dropped. Everything is left-padded (prompts are what generation starts from)."""

    tokenizer: Any
    ignore_index: int = -100
    max_length: int | None = None
    prompt_key: str = "prompt"
    messages_key: str = "messages"

    def __post_init__(self):
        if self.tokenizer.pad_token_id is None:
            raise ValueError("The tokenizer does not have a pad token. Please set `pad_token_id` in the tokenizer.")
        if self.max_length is None:
            self.max_length = min(self.tokenizer.model_max_length, 1024)

    def _ids(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def _prompt_text(self, example: dict) -> str:
        text = example.get(self.prompt_key, example.get("original_prompt_text"))
        if text is None:
            text = self.tokenizer.apply_chat_template(
                example[self.messages_key][:-1], add_generation_prompt=True, tokenize=False
            )
        return text

    def _row(self, example: dict) -> tuple[list[int], list[int], int]:
        """(ids, attention mask, prompt length) of one example."""
        if "input_ids" in example:
            ids = list(example["input_ids"])
            mask = list(example.get("attention_mask") or [1] * len(ids))
            completion = example.get("completion_mask")
            if completion is not None:
                completion = list(completion)
                return ids, mask, completion.index(1) if 1 in completion else len(ids)
            return ids, mask, min(len(self._ids(self._prompt_text(example))), len(ids))
        full = self.tokenizer.apply_chat_template(example[self.messages_key], tokenize=False)
        ids, prompt_len = self._ids(full), len(self._ids(self._prompt_text(example)))
        if len(ids) > self.max_length:
            dropped = len(ids) - self.max_length
            ids, prompt_len = ids[dropped:], max(0, prompt_len - dropped)
        return ids, [1] * len(ids), prompt_len

    def __call__(self, examples: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        rows = [self._row(example) for example in examples]
        if any(prompt_len == 0 for _, _, prompt_len in rows):
            raise ValueError(
                f"An example has no prompt tokens left after truncation to max_length={self.max_length}: the "
                "completion fills the whole window, leaving nothing to generate from. Increase `max_length`."
            )

        def left(seqs, value):
            return pad([torch.tensor(s, dtype=torch.long) for s in seqs], padding_value=value, padding_side="left")

        pad_id = self.tokenizer.pad_token_id
        return {
            "input_ids": left([ids for ids, _, _ in rows], pad_id),
            "attention_mask": left([mask for _, mask, _ in rows], 0),
            "labels": left([[self.ignore_index] * n + ids[n:] for ids, _, n in rows], self.ignore_index),
            "prompts": left([ids[:n] for ids, _, n in rows], pad_id),
            "prompt_attention_mask": left([[1] * n for _, _, n in rows], 0),
        }


__all__ = ["DataCollatorForChatML", "truncate_dataset"]
