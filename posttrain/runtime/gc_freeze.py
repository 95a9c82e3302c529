"""The objects that exist when posttrain's training layer is imported (the modules of torch, transformers,
datasets and posttrain: about half a million on a CPU install) moved out of the garbage collector's scans.

transformers' `Trainer.train()` starts with a full collection (accelerate's `free_memory`), and a full collection
visits every tracked object: about 0.25 CPU-seconds a `train()` call on a 2-core machine, as much as seven steps of
a small reward model, paid again at each automatic full collection. Import-time objects live as long as the
process, so `gc.freeze()` loses nothing: objects created later (models, datasets, trainers, a previous run's
garbage) are collected as before. Only import-time garbage caught in a reference cycle is kept (a bounded few
thousand objects). `POSTTRAIN_GC_FREEZE=0` in the environment turns this off.
"""

from __future__ import annotations

import gc
import os

ENV_VAR = "POSTTRAIN_GC_FREEZE"
_frozen = False


def freeze_import_time_objects() -> bool:
    """Freeze once per process (unless `POSTTRAIN_GC_FREEZE=0`); True when this call froze."""
    global _frozen
    if _frozen or os.environ.get(ENV_VAR, "1").strip().lower() in ("0", "false", "no", "off"):
        return False
    gc.freeze()
    _frozen = True
    return True


__all__ = ["ENV_VAR", "freeze_import_time_objects"]
