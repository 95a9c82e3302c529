"""Packing: several tokenized sequences per row, with their lengths kept in ``seq_lengths`` so that
the collator restarts position ids at each boundary and attention never crosses one.

- ``bfd`` (best-fit decreasing): sequences stay whole; each goes, longest first, into the row with the
  least room that still fits it (ties: the row that reached that room first). Longer-than-row sequences
  are truncated.
- ``bfd_split``: as ``bfd``, but a longer-than-row sequence is cut into row-sized pieces first, so no
  token is lost.
- ``wrapped``: everything is concatenated and cut every ``seq_length`` tokens (no padding at all,
  but sequences are cut across rows).

`pack_dataset` is TRL's public function (same signature, rows and ``seq_lengths``; ``wrapped`` gives no
``seq_lengths``, as in TRL). `pack_sequences` is what posttrain's SFT trainer uses: it drops columns that
are not per-token lists and keeps sequence boundaries under ``wrapped`` too, so attention never crosses
them.
"""

from __future__ import annotations

import bisect
from collections import deque
from typing import Any

from posttrain.errors import ConfigError

STRATEGIES = ("bfd", "bfd_split", "wrapped")


def _bfd_bins(lengths: list[int], capacity: int) -> list[list[int]]:
    """Indices of `lengths` grouped into bins of total length <= capacity, best fit, longest first.

    Among bins with the same room left, the one that reached that room first is filled first.
    """
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])  # stable: equal lengths keep their order
    bins: list[list[int]] = []
    waiting: dict[int, deque] = {}  # room left -> bins with exactly that room, first-come first
    rooms: list[int] = []  # sorted distinct keys of `waiting`
    for i in order:
        pos = bisect.bisect_left(rooms, lengths[i])
        if pos < len(rooms):
            room = rooms[pos]
            b = waiting[room].popleft()
            if not waiting[room]:
                del waiting[room]
                rooms.pop(pos)
        else:
            room, b = capacity, len(bins)
            bins.append([])
        bins[b].append(i)
        left = room - lengths[i]
        if left > 0:
            if left not in waiting:
                waiting[left] = deque()
                bisect.insort(rooms, left)
            waiting[left].append(b)
    return bins


def _pack_batch(batch: dict, seq_length: int, strategy: str, wrapped_boundaries: bool) -> dict:
    columns = [c for c in batch if c != "seq_lengths"]
    n_rows = len(batch[columns[0]])
    pieces = []
    for r in range(n_rows):
        n = len(batch[columns[0]][r])
        if strategy == "wrapped":
            starts = [0]
            step = n
        elif strategy == "bfd_split":
            starts, step = range(0, n, seq_length), seq_length
        else:
            starts, step = [0], seq_length
        for s in starts:
            piece = {c: list(batch[c][r][s : s + step]) for c in columns}
            if piece[columns[0]] or strategy == "wrapped":
                pieces.append(piece)
    out: dict[str, list] = {c: [] for c in columns}
    if strategy != "wrapped":
        out["seq_lengths"] = []
        for members in _bfd_bins([len(p[columns[0]]) for p in pieces], seq_length):
            for c in columns:
                out[c].append([t for i in members for t in pieces[i][c]])
            out["seq_lengths"].append([len(pieces[i][columns[0]]) for i in members])
        return out
    flat = {c: [t for p in pieces for t in p[c]] for c in columns}
    bounds, total = [], 0
    for p in pieces:
        total += len(p[columns[0]])
        bounds.append(total)
    if wrapped_boundaries:
        out["seq_lengths"] = []
    for start in range(0, total, seq_length):
        end = min(start + seq_length, total)
        for c in columns:
            out[c].append(flat[c][start:end])
        if wrapped_boundaries:
            cuts = sorted({start, end, *(b for b in bounds if start < b < end)})
            out["seq_lengths"].append([b - a for a, b in zip(cuts, cuts[1:])])
    return out


def _check_packable(dataset) -> None:
    """TRL's contract: every column holds per-token lists, all of the same length in a row."""
    if hasattr(dataset, "keys"):  # DatasetDict: the first split
        dataset = dataset[next(iter(dataset.keys()))]
    first = next(iter(dataset))
    columns = [c for c in first if c != "seq_lengths"]
    for c in columns:
        if not isinstance(first[c], (list, tuple)):
            raise TypeError(
                f"Packing requires all columns to be lists of lists; column '{c}' holds {type(first[c]).__name__}. "
                f"Remove it first: dataset.remove_columns(['{c}'])."
            )
    if len({len(first[c]) for c in columns}) > 1:
        raise ValueError(
            "All columns must have values of the same length to be packed (one entry per token); got lengths "
            f"{ {c: len(first[c]) for c in columns} } in the first row."
        )


def _output_format(dataset) -> dict[str, Any]:
    """The dataset's output format (type, columns, kwargs), to restore after packing with python lists."""
    if hasattr(dataset, "keys"):  # DatasetDict / IterableDatasetDict: the first split's
        dataset = dataset[next(iter(dataset.keys()))]
    formatting = getattr(dataset, "_formatting", None)  # a stream (IterableDataset) keeps only its format type
    if not hasattr(dataset, "format"):
        return {"type": getattr(formatting, "format_type", None)}
    fmt = dict(dataset.format or {"type": None})
    fmt.update(fmt.pop("format_kwargs", None) or {})
    return fmt


def pack_dataset(dataset, seq_length: int, strategy: str = "bfd", map_kwargs: dict[str, Any] | None = None, **kwargs):
    """Packs a tokenized dataset's sequences into rows of a fixed length, as SFT's `packing=True` does.

    Packs a tokenized dataset's sequences into rows of at most `seq_length` tokens (TRL's function).

    Every column must hold per-token lists (e.g. ``input_ids``, ``attention_mask``); ``bfd`` and
    ``bfd_split`` add ``seq_lengths`` (each row's sequence lengths), ``wrapped`` does not. Empty sequences
    are dropped. `map_kwargs` (and any extra keyword, e.g. ``num_proc``) go to ``dataset.map``; packing
    happens within each map batch. The dataset's format (e.g. torch) is kept.

    See docs/trainers/sft.md.
    """
    if isinstance(map_kwargs, bool) or "split_long" in kwargs:
        # The trainer-side call, `pack_dataset(ds, n, strategy, split_long, num_proc=...)`: see `pack_sequences`.
        split_long = kwargs.pop("split_long", map_kwargs if isinstance(map_kwargs, bool) else False)
        return pack_sequences(dataset, seq_length, strategy, split_long, **kwargs)
    if strategy not in STRATEGIES:
        raise ValueError(f"Invalid packing strategy {strategy!r}, must be one of {STRATEGIES}.")
    fmt = _output_format(dataset)
    dataset = dataset.with_format(None)
    _check_packable(dataset)
    map_kwargs = {**(map_kwargs or {}), **kwargs}
    dataset = dataset.map(
        _pack_batch,
        batched=True,
        fn_kwargs={"seq_length": seq_length, "strategy": strategy, "wrapped_boundaries": False},
        **map_kwargs,
    )
    if strategy != "wrapped" and fmt.get("columns") is not None:
        fmt["columns"] = list(fmt["columns"]) + ["seq_lengths"]
    return dataset.with_format(**fmt)


def pack_sequences(
    dataset,
    seq_length: int,
    strategy: str = "bfd",
    split_long: bool = False,
    batch_size: int = 10_000,
    num_proc: int | None = None,
):
    """posttrain's trainer-side packing: columns that are not per-token lists aligned with ``input_ids``
    are dropped, and every row keeps ``seq_lengths`` (also under ``wrapped``) so that position ids restart
    and attention stops at each original boundary. ``split_long=True`` with ``bfd`` is ``bfd_split``."""
    if strategy not in STRATEGIES:
        raise ConfigError(f"packing_strategy must be one of {STRATEGIES}, got {strategy!r}.")
    if seq_length is None or seq_length <= 0:
        raise ConfigError("Packing needs a positive max_length (the packed row length); set max_length.")
    if strategy == "bfd" and split_long:
        strategy = "bfd_split"
    first = dataset[0]
    drop = [
        c
        for c in dataset.column_names
        if c != "seq_lengths" and not (isinstance(first[c], list) and len(first[c]) == len(first["input_ids"]))
    ]
    dataset = dataset.remove_columns(drop)
    return dataset.map(
        _pack_batch,
        batched=True,
        batch_size=batch_size,
        num_proc=num_proc,
        fn_kwargs={"seq_length": seq_length, "strategy": strategy, "wrapped_boundaries": True},
        remove_columns=dataset.column_names,
        desc=f"Packing ({strategy})",
    )
