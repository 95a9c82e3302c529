"""Where the tests' shared helpers live, for subprocesses a test starts: tests mirror the package
(tests/<layer>/test_<module>.py) and import shared helpers (tests/_*.py, other test modules) by module name."""

from __future__ import annotations

import os
from pathlib import Path

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent
LAYER_FOLDERS = sorted(p for p in TESTS.iterdir() if p.is_dir() and not p.name.startswith((".", "_")))


def subprocess_pythonpath() -> str:
    """PYTHONPATH for a child Python that runs a test file as a script: the repository, tests/ and every layer
    folder."""
    return os.pathsep.join(str(p) for p in (ROOT, TESTS, *LAYER_FOLDERS))
