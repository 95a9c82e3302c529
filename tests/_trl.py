"""TRL for side-by-side tests: skipped where TRL is not installed, except in CI (`CI=1`), where a missing TRL fails
the test, because a parity check that can silently not run is not a check."""

import contextlib
import importlib
import os

import pytest


def in_ci() -> bool:
    """Whether this run is CI (`CI` set to anything but empty, 0 or false, as CI services set it)."""
    return os.environ.get("CI", "").strip().lower() not in ("", "0", "false", "no")


def trl_module(name: str = "trl", reason: str = ""):
    """`importlib.import_module(name)`; where it cannot be imported the test skips, or fails under `CI=1`."""
    try:
        return importlib.import_module(name)
    except ImportError as error:
        why = f"{name} cannot be imported ({error})" + (f": {reason}" if reason else "")
        if in_ci():
            pytest.fail(
                f"{why}. CI=1 refuses to skip a side-by-side test: install TRL with "
                "`.venv/bin/pip install -c scripts/constraints.txt trl==1.16.0` (scripts/setup.sh does)",
                pytrace=False,
            )
        pytest.skip(why)


def import_trl(*trainer_modules: str):
    """`trl`, with `trl.trainer.<module>` imported for each name. tests/vllm (a stand-in package for posttrain's own
    tests) has no version, which TRL's import-time vLLM check cannot parse: TRL is told vLLM is absent meanwhile."""
    trl = trl_module("trl")
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
