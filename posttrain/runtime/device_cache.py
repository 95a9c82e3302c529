"""Returning the accelerator's cached, unused memory to the device (after generation, before a large step)."""

from __future__ import annotations

import torch


def empty_cache() -> None:
    """Empties the allocator cache of the accelerator in use (CUDA, XPU, NPU, MLU or MPS); nothing on a CPU."""
    for name in ("cuda", "xpu", "npu", "mlu", "mps"):
        backend = getattr(torch, name, None)
        available = getattr(backend, "is_available", None)
        if backend is not None and callable(available) and available():
            backend.empty_cache()
            return


__all__ = ["empty_cache"]
