"""Streaming (`datasets.IterableDataset`) training and evaluation data for the trainers that prepare rows up front.

A trainer's `prepare_dataset` validates, tokenizes, drops, truncates and packs a `datasets.Dataset`. A stream has no
length and cannot be indexed or mapped with several processes, so it is prepared lazily in chunks of
`STREAM_CHUNK_ROWS` rows: each chunk becomes a small in-memory Dataset that goes through the trainer's own
`prepare_dataset`, and its prepared rows come out of the stream (packing packs within a chunk). Memory stays bounded
by a chunk, and the rows are exactly what the same chunk as a map-style dataset would give. The first chunk is
prepared once when the trainer is built, so a format or settings error stops the run before training, as it does
for a map-style dataset. Training on a stream needs `max_steps` (transformers asks for it: a stream has no length).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

STREAM_CHUNK_ROWS = 1000


def is_streaming(dataset: Any) -> bool:
    """True for a `datasets.IterableDataset` (a stream: no length, no random access)."""
    try:
        from datasets import IterableDataset
    except ImportError:  # pragma: no cover - datasets is a dependency
        return False
    return isinstance(dataset, IterableDataset)


@contextlib.contextmanager
def _quiet_progress():
    """No progress bar per chunk (a prepared chunk would print one bar per map)."""
    import datasets

    was_enabled = datasets.is_progress_bar_enabled()
    datasets.disable_progress_bars()
    try:
        yield
    finally:
        if was_enabled:
            datasets.enable_progress_bars()


def _column_names(stream) -> list[str]:
    if stream.column_names is not None:
        return list(stream.column_names)
    first = next(iter(stream), None)
    return list(first) if first is not None else []


def _as_batch(prepared, columns: list[str] | None = None) -> dict[str, list]:
    if len(prepared) == 0:
        return {name: [] for name in (columns or prepared.column_names)}
    return prepared.to_dict()


def prepare_streaming(prepare: Callable, stream, chunk_rows: int = STREAM_CHUNK_ROWS):
    """`stream` with `prepare` (a function of a map-style Dataset returning the prepared Dataset) applied chunk by
    chunk as it is read. The first chunk is prepared now: its errors surface here."""
    from datasets import Dataset

    columns = _column_names(stream)
    head = list(stream.take(chunk_rows))
    if head:
        with _quiet_progress():
            prepare(Dataset.from_list(head))

    def prepare_chunk(batch: dict[str, list]) -> dict[str, list]:
        with _quiet_progress():
            return _as_batch(prepare(Dataset.from_dict(batch)))

    prepared = stream.map(prepare_chunk, batched=True, batch_size=chunk_rows, remove_columns=columns)
    prepared.posttrain_prepared = True  # evaluate(dataset) must not prepare it twice
    return prepared


def is_prepared(dataset, column: str) -> bool:
    """True for a dataset a trainer prepared already: a map-style one holding `column`, or a stream it mapped."""
    if is_streaming(dataset):
        return bool(getattr(dataset, "posttrain_prepared", False))
    return column in dataset.column_names


def prepare_any(trainer, dataset, tokenizer, args, name: str):
    """`trainer.prepare_dataset` for a map-style dataset; chunk by chunk for a stream."""
    if is_streaming(dataset):
        return prepare_streaming(lambda chunk: trainer.prepare_dataset(chunk, tokenizer, args, name), dataset)
    return trainer.prepare_dataset(dataset, tokenizer, args, name)


def prepare_datasets(trainer, train_dataset, eval_dataset, tokenizer, args):
    """The train and eval datasets prepared (a dict of eval datasets, e.g. a DatasetDict, entry by entry)."""
    if train_dataset is not None:
        train_dataset = prepare_any(trainer, train_dataset, tokenizer, args, "train_dataset")
    if getattr(trainer, "prepares_eval_on_use", False):
        return train_dataset, eval_dataset
    if isinstance(eval_dataset, dict):
        eval_dataset = {
            key: prepare_any(trainer, value, tokenizer, args, f"eval_dataset[{key!r}]")
            for key, value in eval_dataset.items()
        }
    elif eval_dataset is not None:
        eval_dataset = prepare_any(trainer, eval_dataset, tokenizer, args, "eval_dataset")
    return train_dataset, eval_dataset


class PreparesEvalOnUse:
    """Mixed into a trainer that evaluates through transformers' loop: `trainer.eval_dataset` stays the dataset given
    (as TRL's trainers keep it), and each evaluation set is prepared when its dataloader is first built, once per
    dataset object (a set handed to `evaluate()` too)."""

    prepares_eval_on_use = True

    def get_eval_dataloader(self, eval_dataset=None):
        if not self.prepares_eval_on_use:  # a subclass that prepares its eval sets up front (TRL's GOLD)
            return super().get_eval_dataloader(eval_dataset)
        name = "eval_dataset"
        if isinstance(eval_dataset, str):  # a named set of a dict of eval sets
            name, eval_dataset = f"eval_dataset[{eval_dataset!r}]", self.eval_dataset[eval_dataset]
        dataset = self.eval_dataset if eval_dataset is None else eval_dataset
        if dataset is None:
            return super().get_eval_dataloader(None)  # transformers' error: no eval set
        cache = self.__dict__.setdefault("_eval_prepared", {})
        source, prepared = cache.get(id(dataset), (None, None))
        if source is not dataset:
            prepared = prepare_any(self, dataset, self.processing_class, self.args, name)
            cache[id(dataset)] = (dataset, prepared)  # the source is kept so that its id is not reused
        return super().get_eval_dataloader(prepared)
