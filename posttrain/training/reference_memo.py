"""Reference log-probs kept per row for the rest of training.

A frozen reference gives a row the same log-probs every time the row comes back (the next epoch, an evaluation),
so the values of its first forward are kept, keyed by a digest of the row's token ids, and a batch whose rows are
all known skips the reference forward. Unlike `precompute_ref_log_probs`, nothing runs before the first step: a
single epoch costs what it did, and each later one saves the reference forward. A row met in a differently
composed batch may differ from a fresh forward by float rounding (other padding, other neighbours in the layout),
so the memo is part of a checkpoint: a resumed run reuses the values the uninterrupted run would have reused.

The digests are made in the collator, from the rows' id columns, so the trainer needs nothing else of the row.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

DIGESTS = "ref_row_digests"  # the batch entry: [rows, 2] int64, 128 bits of each row's id columns


def row_digests(examples: list[dict], columns: tuple[str, ...]) -> torch.Tensor:
    """128-bit digests of each example's `columns` (lists of ints, or ints/bools), as [n, 2] int64."""
    out = np.empty((len(examples), 2), dtype=np.int64)
    for i, example in enumerate(examples):
        digest = hashlib.blake2b(digest_size=16)
        for column in columns:
            values = np.asarray(example[column], dtype=np.int64).ravel()
            digest.update(len(values).to_bytes(8, "little"))  # so that no two splits of one stream collide
            digest.update(values.tobytes())
        out[i] = np.frombuffer(digest.digest(), dtype=np.int64)
    return torch.from_numpy(out)


@dataclass
class DigestingCollator:
    """Wraps a collator: the batch also carries each row's digest under `DIGESTS` (none if a row lacks a column)."""

    collator: Callable[[list[dict]], dict]
    columns: tuple[str, ...]

    def __call__(self, examples: list[dict]) -> dict:
        batch = self.collator(examples)
        if all(c in e for e in examples for c in self.columns):
            batch[DIGESTS] = row_digests(examples, self.columns)
        return batch

    def __getattr__(self, name: str) -> Any:  # the wrapped collator's settings stay readable
        if name == "collator":
            raise AttributeError(name)
        return getattr(self.collator, name)


class ReferenceMemo:
    """Each known row's reference values (one float per column), by digest."""

    def __init__(self, columns: tuple[str, ...]):
        self.columns = columns
        self._values: dict[tuple[int, int], tuple[float, ...]] = {}  # Python floats: any dtype's values exactly
        self._dtype = torch.float32  # that of the values stored

    def __len__(self) -> int:
        return len(self._values)

    def lookup(self, digests: torch.Tensor, device) -> dict[str, torch.Tensor] | None:
        """The batch's columns if every row is known, else None."""
        rows = [self._values.get(key) for key in map(tuple, digests.tolist())]
        if not rows or any(row is None for row in rows):
            return None
        values = torch.tensor(rows, dtype=self._dtype, device=device)
        return {column: values[:, i] for i, column in enumerate(self.columns)}

    def store(self, digests: torch.Tensor, values: dict[str, torch.Tensor]) -> None:
        self._dtype = values[self.columns[0]].dtype
        columns = torch.stack([values[c].detach().cpu() for c in self.columns], dim=1).tolist()
        self._values.update(zip(map(tuple, digests.tolist()), map(tuple, columns)))

    def state_dict(self) -> dict[str, torch.Tensor | str]:
        """The memo as tensors for a checkpoint (float64 holds any stored dtype's values exactly)."""
        shape = (len(self._values), len(self.columns))
        keys = torch.tensor(list(self._values), dtype=torch.int64).reshape(shape[0], 2)
        values = torch.tensor(list(self._values.values()), dtype=torch.float64).reshape(shape)
        return {"digests": keys, "values": values, "dtype": str(self._dtype).removeprefix("torch.")}

    def load_state_dict(self, state: dict) -> None:
        """Replaces the memo with a checkpoint's (`state_dict`)."""
        self._dtype = getattr(torch, state["dtype"])
        rows = map(tuple, state["values"].tolist())
        self._values = dict(zip(map(tuple, state["digests"].tolist()), rows))
