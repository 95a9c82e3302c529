"""Index orders for group-sampling methods (GRPO-style): every prompt repeated for its group of completions, and
every batch of prompts repeated for several optimisation passes. `RepeatSampler` orders a map-style dataset;
`repeat_iterable_dataset` gives a streaming dataset the same order (TRL's names, `trl.trainer.utils`)."""

from __future__ import annotations

import copy
from collections.abc import Iterator, Sized

import torch
from torch.utils.data import Sampler


class RepeatSampler(Sampler):
    """Indices of `data_source`, shuffled (with `shuffle`), cut into batches of `batch_size` (an incomplete last
    batch is dropped); each batch is yielded `repeat_count` times, and in it each index `mini_repeat_count` times in
    a row. With mini_repeat_count=2, batch_size=2, repeat_count=2: [4, 4, 3, 3, 4, 4, 3, 3, 0, 0, 1, 1, ...].
    `seed` fixes the shuffles; each new iteration draws a new order."""

    def __init__(
        self,
        data_source: Sized,
        mini_repeat_count: int,
        batch_size: int = 1,
        repeat_count: int = 1,
        shuffle: bool = True,
        seed: int | None = None,
    ):
        self.data_source = data_source
        self.mini_repeat_count = mini_repeat_count
        self.batch_size = batch_size
        self.repeat_count = repeat_count
        self.num_samples = len(data_source)
        self.shuffle = shuffle
        self.seed = seed
        if shuffle:
            self.generator = torch.Generator()
            if seed is not None:
                self.generator.manual_seed(seed)

    def __iter__(self) -> Iterator[int]:
        if self.shuffle:
            order = torch.randperm(self.num_samples, generator=self.generator).tolist()
        else:
            order = list(range(self.num_samples))
        full = self.num_samples // self.batch_size * self.batch_size
        for start in range(0, full, self.batch_size):
            batch = order[start : start + self.batch_size]
            for _ in range(self.repeat_count):
                for index in batch:
                    yield from [index] * self.mini_repeat_count

    def __len__(self) -> int:
        return self.num_samples // self.batch_size * self.batch_size * self.mini_repeat_count * self.repeat_count


def _repeat_batch(columns: dict[str, list], mini_repeat_count: int, repeat_count: int) -> dict[str, list]:
    """One batch of rows in RepeatSampler's order; every repeated value is its own copy (an in-place edit of one
    repeat must not change the others, as with a map-style dataset that builds each row afresh)."""
    rows = len(next(iter(columns.values()))) if columns else 0
    order = [i for _ in range(repeat_count) for i in range(rows) for _ in range(mini_repeat_count)]
    return {name: [copy.deepcopy(values[i]) for i in order] for name, values in columns.items()}


def repeat_iterable_dataset(dataset, mini_repeat_count: int, batch_size: int = 1, repeat_count: int = 1):
    """A streaming (`datasets.IterableDataset`) version of `RepeatSampler` without shuffling: records in batches of
    `batch_size` (an incomplete last batch is dropped), each batch `repeat_count` times, each record
    `mini_repeat_count` times in a row. The result stays chained to `dataset` (lazy), so `set_epoch` reaches an
    upstream `shuffle` and every epoch is reshuffled."""
    return dataset.map(
        _repeat_batch,
        batched=True,
        batch_size=batch_size,
        drop_last_batch=True,
        fn_kwargs={"mini_repeat_count": mini_repeat_count, "repeat_count": repeat_count},
    )


class RepeatBatchLoader:
    """Yields each batch of `dataloader` `repeat_count` times in a row (the same collated object, not collated
    again), for several optimisation passes over one generation batch. Anything else, `set_epoch` included, is
    the wrapped loader's."""

    def __init__(self, dataloader, repeat_count: int):
        if repeat_count < 1:
            raise ValueError(f"repeat_count={repeat_count} must be at least 1.")
        self.dataloader = dataloader
        self.repeat_count = repeat_count

    def __iter__(self) -> Iterator:
        for batch in self.dataloader:
            for _ in range(self.repeat_count):
                yield batch

    def __len__(self) -> int:
        return len(self.dataloader) * self.repeat_count

    def set_epoch(self, epoch: int) -> None:
        if hasattr(self.dataloader, "set_epoch"):
            self.dataloader.set_epoch(epoch)

    def __getattr__(self, name: str):
        if name == "dataloader":  # not set yet (e.g. during unpickling): no recursion
            raise AttributeError(name)
        return getattr(self.dataloader, name)
