"""Activation offloading at TRL's `trl.models.activation_offloading` path: the tensors autograd saves for the
backward pass go to CPU memory during the forward and come back when the backward needs them, trading transfer time
for accelerator memory. posttrain's trainers switch it on with `activation_offloading=True` (torch's
`save_on_cpu`); these are the same mechanism as standalone context managers.

Copies are synchronous: `use_streams` and `max_fwd_stash_size` (TRL's overlap of copies with compute on CUDA
streams) are accepted and change only when a copy happens, never what is computed."""

from __future__ import annotations

import torch
from torch import nn
from torch.autograd.graph import saved_tensors_hooks


def _bytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


class OffloadActivations(saved_tensors_hooks):
    """`with OffloadActivations(): loss = model(**batch).loss; loss.backward()`: every saved tensor of at least
    `min_offload_size` bytes that lives on an accelerator is kept on the CPU (pinned with `use_pin_memory`, so the
    copy back is asynchronous) until the backward reads it. Parameters and CPU tensors stay where they are."""

    def __init__(
        self,
        use_pin_memory: bool = True,
        use_streams: bool = True,
        min_offload_size: int = 1024,
        max_fwd_stash_size: int = 5,
    ) -> None:
        if min_offload_size < 0:
            raise ValueError(f"min_offload_size={min_offload_size} must be >= 0 (bytes).")
        self.use_pin_memory, self.use_streams = use_pin_memory, use_streams
        self.min_offload_size, self.max_fwd_stash_size = min_offload_size, max_fwd_stash_size
        self.offloaded = 0  # tensors moved to the CPU so far

        def pack(tensor: torch.Tensor):
            if tensor.device.type == "cpu" or isinstance(tensor, nn.Parameter) or _bytes(tensor) < min_offload_size:
                return tensor
            self.offloaded += 1
            pin = use_pin_memory and torch.cuda.is_available()
            host = torch.empty(tensor.size(), dtype=tensor.dtype, layout=tensor.layout, pin_memory=pin)
            host.copy_(tensor, non_blocking=pin)
            return tensor.device, host

        def unpack(packed):
            if isinstance(packed, torch.Tensor):
                return packed
            device, host = packed
            return host.to(device, non_blocking=self.use_pin_memory)

        super().__init__(pack, unpack)


class NoOpManager(saved_tensors_hooks):
    """Saved tensors stay as they are inside this context, whatever hooks an outer context installed (the output
    head's activations are read at once by the backward: offloading them only costs two copies)."""

    def __init__(self) -> None:
        super().__init__(lambda tensor: tensor, lambda tensor: tensor)


def get_act_offloading_ctx_manager(
    model: nn.Module,
    use_pin_memory: bool = True,
    use_streams: bool = True,
    min_offload_size: int = 1024,
    max_fwd_stash_size: int = 5,
    warn_if_no_head: bool = True,
) -> OffloadActivations:
    """An `OffloadActivations` context for `model` whose output head (its output embeddings) runs under a
    `NoOpManager`, so everything but the last projection's saved tensors is offloaded."""
    import warnings

    manager = OffloadActivations(use_pin_memory, use_streams, min_offload_size, max_fwd_stash_size)
    get_head = getattr(model, "get_output_embeddings", None)
    head = get_head() if callable(get_head) else None
    if head is None:
        if warn_if_no_head:
            warnings.warn(
                "The model has no output embeddings: every saved tensor is offloaded, the head's too.", stacklevel=2
            )
        return manager
    noop = NoOpManager()
    head.register_forward_pre_hook(lambda *args: noop.__enter__())
    head.register_forward_hook(lambda *args: noop.__exit__(None, None, None))
    return manager


__all__ = ["NoOpManager", "OffloadActivations", "get_act_offloading_ctx_manager"]
