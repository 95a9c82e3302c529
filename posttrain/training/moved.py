"""Names TRL keeps under `trl.experimental` after promoting them to the stable API (`kto`, `distillation`): the
same classes, each warning once per use that the stable import is the one to keep."""

from __future__ import annotations

import inspect
import warnings


def warn_moved(name: str, module: str, stacklevel: int) -> None:
    """FutureWarning: `posttrain.experimental.<module>.<name>` is an alias of the stable `posttrain.<name>`."""
    warnings.warn(
        f"`posttrain.experimental.{module}.{name}` is deprecated and will be removed: {name} is part of the "
        f"stable API. Import it with `from posttrain import {name}` (the same class, same behaviour).",
        FutureWarning,
        stacklevel=stacklevel,
    )


def moved_trainer_init(stable_trainer: type, module: str):
    """An `__init__` for the alias of `stable_trainer` that warns, then runs the stable one; it shows the stable
    signature to `inspect` (TRL users' tooling and posttrain's signature checks read it)."""

    def __init__(self, *args, **kwargs):
        warn_moved(stable_trainer.__name__, module, stacklevel=3)
        stable_trainer.__init__(self, *args, **kwargs)

    __init__.__signature__ = inspect.signature(stable_trainer.__init__)
    return __init__
