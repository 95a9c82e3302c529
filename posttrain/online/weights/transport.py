"""How a version of the policy's weights reaches a rollout worker that shares no memory and no disk with the
trainer: the interface, and the flat layout both ends agree on.

The weights travel as the flat per-dtype buffers of a shared-memory slot (shared_weights.py): one contiguous
buffer per dtype holding every parameter of that dtype in `named_parameters` order (tied parameters once). A push
carries its version, every wait has a deadline, and a failure raises `WeightSyncError` naming the worker and the
version. The implementation is a process group of two per trainer-worker pair (collective.py): gloo on CPU, NCCL
between GPUs, the same code for both.

Under FSDP2 each training rank holds shards: `gathered_params` gathers every parameter on every rank (a collective
of the training group, all gathers before any send), and rank 0 alone packs and sends. A send between two gathers,
on a group the other ranks are not in, is how weight syncs hang without an error (TRL #7103/#7131).
"""

from __future__ import annotations

import hashlib
from typing import Protocol

import torch

from posttrain.generation.vllm_weights import gathered_params  # shared with the vLLM NCCL sync

__all__ = [
    "WeightReceiver",
    "WeightSender",
    "WeightSyncError",
    "buffer_hashes",
    "flat_buffers",
    "flat_layout",
    "gathered_params",
    "pack",
]

Layout = list[tuple[torch.dtype, torch.Size, int]]


class WeightSyncError(RuntimeError):
    """A push of one version to one worker failed or passed its deadline."""


class WeightSender(Protocol):
    def send(self, buffers: dict[torch.dtype, torch.Tensor], version: int) -> None: ...

    def close(self) -> None: ...


class WeightReceiver(Protocol):
    def receive(self, buffers: dict[torch.dtype, torch.Tensor]) -> int: ...

    def close(self) -> None: ...


def flat_layout(model) -> Layout:
    """(dtype, shape, numel) of each parameter of `model`, in `named_parameters` order (a tied one once)."""
    return [(p.dtype, p.shape, p.numel()) for _, p in model.named_parameters()]


def flat_buffers(layout: Layout) -> dict[torch.dtype, torch.Tensor]:
    """One empty buffer per dtype, large enough for the parameters of that dtype."""
    sizes: dict[torch.dtype, int] = {}
    for dtype, _, numel in layout:
        sizes[dtype] = sizes.get(dtype, 0) + numel
    return {dtype: torch.empty(size, dtype=dtype) for dtype, size in sizes.items()}


@torch.no_grad()
def pack(params: list[torch.Tensor], buffers: dict[torch.dtype, torch.Tensor]) -> dict[torch.dtype, torch.Tensor]:
    """Copies `params` (in `named_parameters` order) into `buffers`, the layout of `flat_buffers`."""
    offsets = dict.fromkeys(buffers, 0)
    for param in params:
        start = offsets[param.dtype]
        buffers[param.dtype][start : start + param.numel()].copy_(param.detach().reshape(-1))
        offsets[param.dtype] = start + param.numel()
    return buffers


def buffer_hashes(buffers: dict[torch.dtype, torch.Tensor]) -> dict[str, str]:
    """A sha256 of each buffer's bytes, by dtype name (the same on every machine that holds the same weights)."""
    return {
        str(dtype): hashlib.sha256(buffer.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()
        for dtype, buffer in sorted(buffers.items(), key=lambda item: str(item[0]))
    }
