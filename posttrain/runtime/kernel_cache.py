"""A smaller bound on the CPU kernels oneDNN keeps compiled, one set per matrix shape.

On a CPU, torch runs bfloat16 (and float16) matmuls, and the matmuls inside attention, through oneDNN, which
compiles a kernel for each new shape and keeps it in two caches: oneDNN's own primitive cache and ideep's LRU
cache in torch, 1,024 entries each by default. A kernel takes about 0.65 MB (measured: a bf16 `Linear` costs
about 2 MB of RSS for each new number of rows, its forward and two backward matmuls), and a kernel is freed only
once both caches drop it. Training with varying lengths meets new shapes at every step (posttrain's packed and
shared-prompt layouts more often than a padded batch), so resident memory grew by about 10 MB a step under bf16
autocast on a tiny reward model until the caches were full: 30 steps took it from 540 to 820 MB.

A step of any trainer here uses a few dozen shapes, reused across layers, heads and the backward; a kernel for a
shape seen several steps ago is rarely used again (each new length is a new shape), so 64 entries keep what a
step reuses. Only the capacity changes: the kernels, and so the numbers computed, are the same
(tests/runtime/test_kernel_cache.py). A value the user set wins (`ONEDNN_PRIMITIVE_CACHE_CAPACITY`, its older
name `DNNL_PRIMITIVE_CACHE_CAPACITY`, `LRU_CACHE_CAPACITY`; 1024 each restores torch's default). Both caches read
their capacity when the process first compiles a oneDNN kernel, so this must run before then: posttrain does it
when its training layer is imported.
"""

from __future__ import annotations

import os

CAPACITY = 64
# each cache, with the variables that set its capacity (any one of them set by the user: left as is)
CACHE_VARIABLES = (
    ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "DNNL_PRIMITIVE_CACHE_CAPACITY"),  # oneDNN's primitive cache
    ("LRU_CACHE_CAPACITY",),  # ideep's, inside torch
)


def bound_kernel_caches(capacity: int = CAPACITY) -> dict[str, str]:
    """Sets each cache's capacity where the user has not; returns the variables set."""
    set_here = {}
    for names in CACHE_VARIABLES:
        if not any(name in os.environ for name in names):
            os.environ[names[0]] = set_here[names[0]] = str(capacity)
    return set_here


__all__ = ["CACHE_VARIABLES", "CAPACITY", "bound_kernel_caches"]
