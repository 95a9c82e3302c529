"""Packing: several tokenized sequences per row, with their lengths kept in ``seq_lengths`` so that
the collator restarts position ids at each boundary and attention never crosses one.

- ``bfd`` (best-fit decreasing): sequences stay whole; each goes, longest first, into the row with the
  least room that still fits it. Longer-than-row sequences are truncated, or split with
  ``split_long=True``.
- ``wrapped``: everything is concatenated and cut every ``seq_length`` tokens (no padding at all,
  but sequences are cut across rows).
"""

from __future__ import annotations

import bisect

from ..errors import ConfigError


def _bfd_bins(lengths: list[int], capacity: int) -> list[list[int]]:
    """Indices of `lengths` grouped into bins of total length <= capacity, best fit, longest first."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    bins: list[list[int]] = []
    # (remaining room, bin index), kept sorted so the tightest fitting bin is a bisect away.
    rooms: list[tuple[int, int]] = []
    for i in order:
        pos = bisect.bisect_left(rooms, (lengths[i], -1))
        if pos < len(rooms):
            room, b = rooms.pop(pos)
        else:
            room, b = capacity, len(bins)
            bins.append([])
        bins[b].append(i)
        bisect.insort(rooms, (room - lengths[i], b))
    return bins


def _pack_batch(batch: dict, seq_length: int, strategy: str, split_long: bool) -> dict:
    columns = [c for c in batch if c != "seq_lengths"]
    rows = [{c: batch[c][i] for c in columns} for i in range(len(batch["input_ids"]))]
    # Sequences too long for a row: split into row-sized pieces, or truncated.
    pieces = []
    for r in rows:
        n = len(r["input_ids"])
        starts = range(0, n, seq_length) if (split_long or strategy == "wrapped") else [0]
        for s in starts:
            pieces.append({c: r[c][s : s + seq_length] for c in columns})
    out: dict[str, list] = {c: [] for c in columns}
    out["seq_lengths"] = []
    if strategy == "bfd":
        for members in _bfd_bins([len(p["input_ids"]) for p in pieces], seq_length):
            for c in columns:
                out[c].append([t for i in members for t in pieces[i][c]])
            out["seq_lengths"].append([len(pieces[i]["input_ids"]) for i in members])
    else:
        flat = {c: [t for p in pieces for t in p[c]] for c in columns}
        bounds, total = [], 0
        for p in pieces:
            total += len(p["input_ids"])
            bounds.append(total)
        for start in range(0, total, seq_length):
            end = min(start + seq_length, total)
            for c in columns:
                out[c].append(flat[c][start:end])
            cuts = sorted({start, end, *(b for b in bounds if start < b < end)})
            out["seq_lengths"].append([b - a for a, b in zip(cuts, cuts[1:])])
    return out


def pack_dataset(dataset, seq_length: int, strategy: str = "bfd", split_long: bool = False,
                 batch_size: int = 10_000, num_proc: int | None = None):
    """Packs the list columns of a tokenized dataset into rows of at most `seq_length` tokens.

    Every column must hold per-token lists aligned with ``input_ids`` (e.g. ``completion_mask``); other
    columns are dropped. Packing happens within chunks of `batch_size` rows.
    """
    if strategy not in ("bfd", "wrapped"):
        raise ConfigError(f"packing_strategy must be 'bfd' or 'wrapped', got {strategy!r}.")
    if seq_length is None or seq_length <= 0:
        raise ConfigError("Packing needs a positive max_length (the packed row length); set max_length.")
    first = dataset[0]
    drop = [c for c in dataset.column_names
            if c != "seq_lengths" and not (isinstance(first[c], list) and len(first[c]) == len(first["input_ids"]))]
    dataset = dataset.remove_columns(drop)
    return dataset.map(
        _pack_batch, batched=True, batch_size=batch_size, num_proc=num_proc,
        fn_kwargs={"seq_length": seq_length, "strategy": strategy, "split_long": split_long},
        remove_columns=dataset.column_names, desc=f"Packing ({strategy})",
    )
