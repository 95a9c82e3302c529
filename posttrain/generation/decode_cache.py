"""A key/value cache layer for the decode loop that writes each step's keys in place instead of concatenating.

transformers' `DynamicLayer` grows its keys and values with `torch.cat` at every step, which copies the whole
cache of every layer once per token: at 64 rows and a few hundred tokens that copy (and the fresh allocation it
needs) costs more than the attention that reads it. `ReservedLayer` keeps the keys and values in a buffer with
room for `chunk` more positions, writes each step's into it and hands attention a view of the filled part: the same
values, so the same attention output, and a copy of the cache only once every `chunk` steps (or when finished rows
leave the batch). Sliding-window layers, which drop old positions, stay as they are.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import DynamicLayer


class ReservedLayer(DynamicLayer):
    """A `DynamicLayer` whose `keys`/`values` are views of the first `length` positions of a larger buffer."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, chunk: int, limit: int) -> None:
        super().__init__()
        self.chunk, self.limit = chunk, limit
        self.is_initialized, self.device = True, keys.device
        self._reserve(keys, values, keys.shape[-2])

    def _reserve(self, keys: torch.Tensor, values: torch.Tensor, needed: int) -> None:
        """New buffers holding `keys`/`values` with room for at least `needed` positions."""
        capacity = max(needed, min(keys.shape[-2] + self.chunk, self.limit))
        length = keys.shape[-2]
        self.key_buffer = keys.new_empty((*keys.shape[:-2], capacity, keys.shape[-1]))
        self.value_buffer = values.new_empty((*values.shape[:-2], capacity, values.shape[-1]))
        self.key_buffer[..., :length, :] = keys
        self.value_buffer[..., :length, :] = values
        self.keys, self.values = self.key_buffer[..., :length, :], self.value_buffer[..., :length, :]

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        start = self.keys.shape[-2]
        end = start + key_states.shape[-2]
        if end > self.key_buffer.shape[-2]:
            self._reserve(self.keys, self.values, end)
        self.key_buffer[..., start:end, :] = key_states
        self.value_buffer[..., start:end, :] = value_states
        self.keys, self.values = self.key_buffer[..., :end, :], self.value_buffer[..., :end, :]
        return self.keys, self.values

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._reserve(self.keys.repeat_interleave(repeats, dim=0), self.values.repeat_interleave(repeats, dim=0), 0)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._reserve(self.keys[indices], self.values[indices], 0)

    def crop(self, tokens_to_remove: int) -> None:
        super().crop(tokens_to_remove)  # views of the buffer: the next update writes after them

    def reset(self) -> None:
        self.key_buffer = self.value_buffer = None
        super().reset()


def reserve(cache, chunk: int, limit: int) -> None:
    """Replaces each plain `DynamicLayer` of `cache` (after its prefill) by a `ReservedLayer` holding the same keys
    and values, growing by `chunk` positions at a time up to `limit` (the longest a row can get)."""
    for index, layer in enumerate(cache.layers):
        if type(layer) is DynamicLayer and layer.is_initialized and layer.keys.numel():
            cache.layers[index] = ReservedLayer(layer.keys, layer.values, chunk, limit)
