"""Collators with TRL's names and batch layouts, for code that builds its own batches the way TRL's trainers do:
`DataCollatorForLanguageModeling` (SFT), `DataCollatorForPreference` (DPO: prompt + chosen / rejected ids; the
reward model's: whole chosen / rejected sequences), `DataCollatorForUnpairedPreference` (KTO, with its KL pairs).

posttrain's trainers batch with their own collators (`collators.py`, `preference.py`), which lay rows out for their
fused forwards; these take TRL's tokenized rows and give TRL's tensors. Padding is on the right; `pad_to_multiple_of`
rounds the padded length up.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from posttrain.data.batches import pad

IGNORE_INDEX = -100


def _mask(rows: list[list[int]], multiple: int | None) -> torch.Tensor:
    return pad([[1] * len(r) for r in rows], 0, "right", multiple)


def _floats(examples: list[dict], key: str) -> torch.Tensor:
    return torch.tensor([float(e[key]) for e in examples])


@dataclass
class DataCollatorForLanguageModeling:
    """SFT batches from rows with `input_ids` (and `labels`, used as given; else the input ids, with -100 where a
    `completion_mask` or `assistant_masks` of the row is 0). Padded: input_ids, attention_mask, labels (-100 on
    padding). `padding_free=True`: every row end to end in one row with `position_ids` restarting per sequence (a
    packed row's `seq_lengths` give its sequences), the first token of each sequence labelled -100, no attention
    mask; `return_position_ids` adds position ids to the padded layout too."""

    pad_token_id: int
    padding_free: bool = False
    return_position_ids: bool = False
    pad_to_multiple_of: int | None = None
    return_tensors: str = "pt"

    @staticmethod
    def get_position_ids_from_packed_seq_lengths(batch_seq_lengths: list[list[int]]) -> list[torch.Tensor]:
        """Per row, positions restarting at 0 at every sequence of the row (`seq_lengths`)."""
        return [torch.cat([torch.arange(n) for n in lengths]) for lengths in batch_seq_lengths]

    @staticmethod
    def _labels(example: dict) -> list[int]:
        if example.get("labels") is not None:
            return list(example["labels"])
        masks = [m for m in (example.get("completion_mask"), example.get("assistant_masks")) if m is not None]
        return [t if all(bits) else IGNORE_INDEX for t, *bits in zip(example["input_ids"], *masks)]

    def __call__(self, examples: list[dict]) -> dict[str, torch.Tensor]:
        ids = [list(e["input_ids"]) for e in examples]
        labels = [self._labels(e) for e in examples]
        lengths = [e.get("seq_lengths") or [len(i)] for e, i in zip(examples, ids)]
        positions = [p.tolist() for p in self.get_position_ids_from_packed_seq_lengths(lengths)]
        if self.padding_free:
            flat_labels = [IGNORE_INDEX if p == 0 else t for ps, ls in zip(positions, labels) for p, t in zip(ps, ls)]
            return {
                "input_ids": pad([sum(ids, [])], self.pad_token_id, pad_to_multiple_of=self.pad_to_multiple_of),
                "position_ids": pad([sum(positions, [])], 0, pad_to_multiple_of=self.pad_to_multiple_of),
                "labels": pad([flat_labels], IGNORE_INDEX, pad_to_multiple_of=self.pad_to_multiple_of),
            }
        out = {
            "input_ids": pad(ids, self.pad_token_id, pad_to_multiple_of=self.pad_to_multiple_of),
            "attention_mask": _mask(ids, self.pad_to_multiple_of),
            "labels": pad(labels, IGNORE_INDEX, pad_to_multiple_of=self.pad_to_multiple_of),
        }
        if self.return_position_ids:
            out["position_ids"] = pad([list(range(len(i))) for i in ids], 0, pad_to_multiple_of=self.pad_to_multiple_of)
        return out


@dataclass
class DataCollatorForPreference:
    """DPO batches from rows with `prompt_ids`, `chosen_ids`, `rejected_ids`: the chosen sequences (prompt +
    completion) of every row, then the rejected ones, as input_ids, attention_mask and completion_mask; reference
    log-probs (`ref_chosen_logps`, `ref_rejected_logps`) pass through as tensors. Rows without `prompt_ids` (a reward
    model's whole `chosen_ids` / `rejected_ids` sequences) give input_ids and attention_mask, and `margin` if present.
    `max_length` cuts each sequence (`truncation_mode` "keep_start" or "keep_end")."""

    pad_token_id: int
    max_length: int | None = None
    truncation_mode: str = "keep_start"
    pad_to_multiple_of: int | None = None
    return_tensors: str = "pt"

    def _cut(self, sequence: list[int], mask: list[int]) -> tuple[list[int], list[int]]:
        if self.max_length is None or len(sequence) <= self.max_length:
            return sequence, mask
        if self.truncation_mode == "keep_end":
            return sequence[-self.max_length :], mask[-self.max_length :]
        return sequence[: self.max_length], mask[: self.max_length]

    def __call__(self, examples: list[dict]) -> dict[str, torch.Tensor]:
        sequences, masks = [], []
        for side in ("chosen_ids", "rejected_ids"):
            for e in examples:
                prompt = list(e.get("prompt_ids") or [])
                completion = list(e[side])
                sequence, mask = self._cut(prompt + completion, [0] * len(prompt) + [1] * len(completion))
                sequences.append(sequence)
                masks.append(mask)
        out = {
            "input_ids": pad(sequences, self.pad_token_id, pad_to_multiple_of=self.pad_to_multiple_of),
            "attention_mask": _mask(sequences, self.pad_to_multiple_of),
        }
        if any("prompt_ids" in e for e in examples):
            out["completion_mask"] = pad(masks, 0, pad_to_multiple_of=self.pad_to_multiple_of)
        for key in ("ref_chosen_logps", "ref_rejected_logps", "margin"):
            if all(key in e for e in examples):
                out[key] = _floats(examples, key)
        return out


@dataclass
class DataCollatorForUnpairedPreference:
    """KTO batches from rows with `prompt_ids`, `completion_ids`, `KL_completion_ids` and `label`: the sequences
    (prompt + completion) as input_ids, attention_mask, completion_mask, the KL pairs (prompt + another row's
    completion) as KL_input_ids, KL_attention_mask, KL_completion_mask, the labels, and `ref_logps` / `ref_KL_logps`
    when the rows carry them. `max_length` cuts each sequence at its end."""

    pad_token_id: int
    max_length: int | None = None
    pad_to_multiple_of: int | None = None
    return_tensors: str = "pt"

    def _side(self, examples: list[dict], key: str, prefix: str) -> dict[str, torch.Tensor]:
        sequences, masks = [], []
        for e in examples:
            prompt, completion = list(e["prompt_ids"]), list(e[key])
            sequence, mask = prompt + completion, [0] * len(prompt) + [1] * len(completion)
            if self.max_length is not None:
                sequence, mask = sequence[: self.max_length], mask[: self.max_length]
            sequences.append(sequence)
            masks.append(mask)
        return {
            f"{prefix}input_ids": pad(sequences, self.pad_token_id, pad_to_multiple_of=self.pad_to_multiple_of),
            f"{prefix}attention_mask": _mask(sequences, self.pad_to_multiple_of),
            f"{prefix}completion_mask": pad(masks, 0, pad_to_multiple_of=self.pad_to_multiple_of),
        }

    def __call__(self, examples: list[dict]) -> dict[str, torch.Tensor]:
        out = self._side(examples, "completion_ids", "")
        if all("KL_completion_ids" in e for e in examples):
            out.update(self._side(examples, "KL_completion_ids", "KL_"))
        for key in ("ref_logps", "ref_KL_logps"):
            if all(key in e for e in examples):
                out[key] = _floats(examples, key)
        out["label"] = torch.tensor([bool(e["label"]) for e in examples])
        return out


__all__ = ["DataCollatorForLanguageModeling", "DataCollatorForPreference", "DataCollatorForUnpairedPreference"]
