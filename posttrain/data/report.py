"""What data preparation cut or dropped, said once before training (issue #15, "nothing changed silently").

Preparation code records, per dataset, the rows it received, the rows it dropped (and why) and the rows and tokens
it truncated (and why). `DataReportCallback` logs the summary when training begins and writes it to
``output_dir/data_report.json``.

The API is small on purpose:

- ``DataReport.of(trainer).start(name, rows_in)`` opens a dataset's section (a `DatasetReport`);
- ``section.dropped(n, why)`` / ``section.truncated(rows, tokens, why)`` record counts;
- per-row cuts made inside ``dataset.map`` (which may run in other processes, or come from the cache) travel as
  extra columns named ``cut_column(key)``; ``section.take_cuts(dataset)`` sums and removes them.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass, field

from transformers import TrainerCallback

logger = logging.getLogger("posttrain")

CUT_PREFIX = "_posttrain_cut__"
# Why a per-row cut column's tokens were removed, by the column's key.
CUT_REASONS = {
    "max_length": "sequence longer than max_length",
    "max_prompt_length": "prompt longer than max_prompt_length (its start removed)",
    "max_completion_length": "completion longer than max_completion_length (its end removed)",
}


def cut_column(key: str) -> str:
    """The name of the extra column that carries, per row, how many tokens `key`'s limit removed."""
    return CUT_PREFIX + key


@dataclass
class DatasetReport:
    """One dataset's counts: rows in, rows dropped by reason, rows/tokens truncated by reason, other notes."""

    rows_in: int
    dropped_rows: dict[str, int] = field(default_factory=dict)
    truncations: dict[str, dict[str, int]] = field(default_factory=dict)
    notes: dict[str, int] = field(default_factory=dict)

    def dropped(self, n: int, why: str) -> None:
        if n:
            self.dropped_rows[why] = self.dropped_rows.get(why, 0) + int(n)

    def truncated(self, rows: int, tokens: int, why: str) -> None:
        if rows:
            entry = self.truncations.setdefault(why, {"rows": 0, "tokens": 0})
            entry["rows"] += int(rows)
            entry["tokens"] += int(tokens)

    def note(self, n: int, what: str) -> None:
        """A count that loses no token but changes the data's shape (e.g. sequences split across packed rows)."""
        if n:
            self.notes[what] = self.notes.get(what, 0) + int(n)

    def take_cuts(self, dataset):
        """Records the per-row cut columns of `dataset` (see `cut_column`) and returns it without them."""
        columns = [c for c in dataset.column_names if c.startswith(CUT_PREFIX)]
        for column in columns:
            cuts = [int(n) for n in dataset[column]]
            key = column[len(CUT_PREFIX) :]
            self.truncated(sum(n > 0 for n in cuts), sum(cuts), CUT_REASONS.get(key, key))
        return dataset.remove_columns(columns) if columns else dataset

    def overlong(self, lengths, max_length: int | None, why: str) -> None:
        """Records the sequences of `lengths` that a later cut to `max_length` (a collator, packing) shortens."""
        if max_length is None:
            return
        over = [n - max_length for n in lengths if n > max_length]
        self.truncated(len(over), sum(over), why)

    def as_dict(self) -> dict:
        dropped = sum(self.dropped_rows.values())
        return {
            "rows_in": self.rows_in,
            "rows_kept": self.rows_in - dropped,
            "rows_dropped": dropped,
            "dropped": dict(self.dropped_rows),
            "rows_truncated": sum(t["rows"] for t in self.truncations.values()),
            "tokens_cut": sum(t["tokens"] for t in self.truncations.values()),
            "truncated": {k: dict(v) for k, v in self.truncations.items()},
            "notes": dict(self.notes),
        }

    @property
    def changed(self) -> bool:
        return bool(self.dropped_rows or self.truncations)


class DataReport:
    """The sections of every dataset a trainer prepared, in preparation order."""

    def __init__(self):
        self.datasets: dict[str, DatasetReport] = {}
        self.emitted = False

    @classmethod
    def of(cls, owner) -> DataReport:
        """The report attached to `owner` (a trainer), created on first use."""
        report = owner.__dict__.get("_data_report")
        if report is None:
            report = owner.__dict__["_data_report"] = cls()
        return report

    def start(self, name: str, rows_in: int) -> DatasetReport:
        """A fresh section for `name` (preparing the same dataset again replaces its counts)."""
        self.datasets[name] = DatasetReport(rows_in=int(rows_in))
        return self.datasets[name]

    def as_dict(self) -> dict:
        return {name: section.as_dict() for name, section in self.datasets.items()}

    def lines(self) -> list[str]:
        out = []
        for name, d in self.as_dict().items():
            line = f"{name}: {d['rows_in']} rows in, {d['rows_kept']} kept"
            for why, n in d["dropped"].items():
                line += f"; {n} dropped ({why})"
            for why, t in d["truncated"].items():
                line += f"; {t['rows']} truncated, {t['tokens']} tokens cut ({why})"
            for what, n in d["notes"].items():
                line += f"; {n} {what}"
            out.append(line)
        return out

    def emit(self, output_dir: str | None) -> dict:
        """Logs the summary (a warning when anything was cut or dropped) and writes data_report.json; once."""
        summary = self.as_dict()
        if self.emitted or not summary:
            return summary
        self.emitted = True
        changed = any(s.changed for s in self.datasets.values())
        logger.log(
            logging.WARNING if changed else logging.INFO,
            "Data preparation report (before training):\n  %s",
            "\n  ".join(self.lines()),
        )
        if output_dir:
            os.makedirs(output_dir, exist_ok=True)
            with open(os.path.join(output_dir, "data_report.json"), "w") as f:
                json.dump(summary, f, indent=2)
        return summary


class DataReportCallback(TrainerCallback):
    """Emits the trainer's `DataReport` when training begins (on the main process only)."""

    def __init__(self, trainer):
        self.trainer = trainer

    def on_train_begin(self, args, state, control, **kwargs):
        if state.is_world_process_zero:
            DataReport.of(self.trainer).emit(args.output_dir)


def note_packing(
    report: DatasetReport, dataset, seq_length: int, strategy: str, split_long: bool, batch_size: int = 10_000
) -> None:
    """Records what packing `dataset` (tokenized, not yet packed) into rows of `seq_length` will change:
    ``bfd`` truncates longer sequences, ``bfd_split`` splits them into pieces, ``wrapped`` cuts sequences at row
    boundaries (packing works per map batch of `batch_size` rows); empty sequences are dropped."""
    if "seq_lengths" in dataset.column_names:  # packed already: repacking keeps its rows as they are
        return
    lengths = [len(ids) for ids in dataset["input_ids"]]
    if strategy != "wrapped":
        report.dropped(sum(n == 0 for n in lengths), "empty sequence (packing drops it)")
    if strategy == "wrapped":
        split = 0
        for start in range(0, len(lengths), batch_size):
            end_of = 0
            for n in lengths[start : start + batch_size]:
                begin, end_of = end_of, end_of + n
                split += n > 0 and begin // seq_length != (end_of - 1) // seq_length
        report.note(split, "sequences split across packed rows (wrapped packing; no token lost)")
    elif split_long:
        report.note(
            sum(n > seq_length for n in lengths),
            "sequences longer than max_length split into pieces (bfd_split; no token lost)",
        )
    else:
        report.overlong(lengths, seq_length, "sequence longer than max_length (bfd packing keeps its start)")
