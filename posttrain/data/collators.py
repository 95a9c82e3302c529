"""Collators: lists of tokenized examples -> model-ready tensors.

Labels are the input ids with -100 wherever a token is not trained (prompt, user turns, padding).

Padding-free batches put every sequence of the batch end to end in one row. Position ids restart at 0
for each sequence and no ``attention_mask`` is passed: from the restarts transformers builds a
block-diagonal causal mask (sdpa / eager / flex) or varlen kernels (flash attention), so no token
attends across a boundary. The first token of each sequence gets label -100: it would otherwise be
the target of the previous sequence's last token.

With sdpa / eager, a single row of T tokens costs T^2 attention however short its sequences are, so
`one_row=False` keeps each example in its own row instead (cost: sum of row lengths squared). Rows are
right-padded to the longest one; the padding is one more dummy sequence (positions 0..k, labels -100),
so still no attention mask is needed. Flash attention finds sequence boundaries only within a batch of
one row, so it needs `one_row=True`.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import chain

import torch

from posttrain.data.batches import pad

IGNORE_INDEX = -100


def _labels(example: dict) -> list[int]:
    """The example's `labels` if it has them, else its input ids with -100 where `completion_mask` or
    `assistant_masks` (whichever it has) is 0."""
    if example.get("labels") is not None:
        return list(example["labels"])
    ids = example["input_ids"]
    masks = [m for m in (example.get("completion_mask"), example.get("assistant_masks")) if m is not None]
    if not masks:
        return list(ids)
    return [t if all(bits) else IGNORE_INDEX for t, *bits in zip(ids, *masks)]


def _restarting_row(example: dict) -> tuple[list[int], list[int], list[int]]:
    """One example's input ids, labels and position ids, with positions restarting at each of its
    sequences (`seq_lengths`, else one sequence) and label -100 on every sequence's first token."""
    positions = [p for length in example.get("seq_lengths") or [len(example["input_ids"])] for p in range(length)]
    labels = [IGNORE_INDEX if p == 0 else t for p, t in zip(positions, _labels(example))]
    return list(example["input_ids"][: len(positions)]), labels, positions


@dataclass
class LanguageModelingCollator:
    """Batches tokenized SFT rows: padding or padding-free, with the labels of the trained tokens only.

    Collates `input_ids` (+ optional `labels` or `completion_mask` / `assistant_masks`, `seq_lengths`) for
    causal language modeling; `pad_to_multiple_of` rounds the padded length up.

    Packed examples (with `seq_lengths`) are always collated padding-free: padding a packed row would
    need an attention mask, and an attention mask would hide the sequence boundaries from the model.
    `one_row` picks the padding-free layout: the whole batch in one row (needed by flash attention), or
    one row per example, padded with a dummy sequence (cheaper with sdpa / eager attention).

    See docs/trainers/sft.md.
    """

    pad_token_id: int
    padding_free: bool = False
    pad_to_multiple_of: int | None = None
    one_row: bool = True

    def __call__(self, examples: list[dict]) -> dict[str, torch.Tensor]:
        if self.padding_free or any("seq_lengths" in e for e in examples):
            return self._padding_free(examples)
        labels = [_labels(e) for e in examples]
        input_ids = pad(
            [e["input_ids"] for e in examples], self.pad_token_id, pad_to_multiple_of=self.pad_to_multiple_of
        )
        attention_mask = pad(
            [[1] * len(e["input_ids"]) for e in examples], 0, pad_to_multiple_of=self.pad_to_multiple_of
        )
        return {
            "input_ids": input_ids,
            "attention_mask": attention_mask,
            "labels": pad(labels, IGNORE_INDEX, pad_to_multiple_of=self.pad_to_multiple_of),
        }

    def _padding_free(self, examples: list[dict]) -> dict[str, torch.Tensor]:
        rows = [_restarting_row(e) for e in examples]
        if self.one_row:
            rows = [tuple(list(chain.from_iterable(parts)) for parts in zip(*rows))]
        longest = max(len(ids) for ids, _, _ in rows)
        if self.pad_to_multiple_of:
            longest = -(-longest // self.pad_to_multiple_of) * self.pad_to_multiple_of
        input_ids, labels, position_ids = [], [], []
        for ids, row_labels, positions in rows:
            tail = longest - len(ids)
            input_ids.append(ids + [self.pad_token_id] * tail)
            labels.append(row_labels + [IGNORE_INDEX] * tail)
            position_ids.append(positions + list(range(tail)))
        return {
            "input_ids": torch.tensor(input_ids, dtype=torch.long),
            "position_ids": torch.tensor(position_ids, dtype=torch.long),
            "labels": torch.tensor(labels, dtype=torch.long),
            # Real (non-padding) tokens per row: the rows carry no attention mask to count them from.
            "num_input_tokens": torch.tensor([len(ids) for ids, _, _ in rows], dtype=torch.long),
            "use_cache": False,
        }
