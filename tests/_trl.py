"""TRL for side-by-side tests (skipped where TRL is not installed)."""

import contextlib
import importlib

import pytest


def import_trl(*trainer_modules: str):
    """`trl`, with `trl.trainer.<module>` imported for each name. tests/vllm (a stand-in package for posttrain's own
    tests) has no version, which TRL's import-time vLLM check cannot parse: TRL is told vLLM is absent meanwhile."""
    trl = pytest.importorskip("trl")
    with _vllm_hidden():
        for name in trainer_modules:
            importlib.import_module(f"trl.trainer.{name}")
    return trl


def import_trl_experimental(name: str):
    """`trl.experimental.<name>`, imported while TRL is told vLLM is absent (see `import_trl`)."""
    import_trl()
    with _vllm_hidden():
        return importlib.import_module(f"trl.experimental.{name}")


@contextlib.contextmanager
def _vllm_hidden():
    import trl.import_utils as import_utils

    original = import_utils.is_vllm_available
    import_utils.is_vllm_available = lambda *a, **k: False
    try:
        yield
    finally:
        import_utils.is_vllm_available = original
