"""pytest plugin for running TRL's own test suite offline (loaded with `-p trl_suite_plugin` by
scripts/trl_testsuite.sh; never by posttrain's own tests).

- TRL_SUITE_LIB=posttrain installs the `trl` -> `posttrain` import alias (trl_alias.py) before TRL's conftest runs;
- `load_dataset("trl-internal-testing/zen", ...)` reads the local stand-in built by standins.py (TRL_SUITE_CACHE);
- --trl-sample FILE=K,...  keeps every K-th collected test of FILE (indices 0, K, 2K, ... in collection order);
  FILE is a path under tests/ or a base name; `*=K` sets the rate for the files not named;
  --trl-select PATH  keeps only the node ids listed in PATH (one a line; CI's fixed sample);
- --trl-json PATH  writes every test's outcome, duration and first error line (the input of compare.py);
- --trl-timeout S  fails a test that runs longer than S seconds (SIGALRM; a hung test would stop the whole run).
"""

from __future__ import annotations

import builtins
import json
import os
import signal
import sys
import time
import types
from pathlib import Path

import pytest

LIB = os.environ.get("TRL_SUITE_LIB", "trl")
CACHE = Path(os.environ.get("TRL_SUITE_CACHE", ".cache/trl_suite"))
LOCAL_DATASETS = {"trl-internal-testing/zen": CACHE / "datasets" / "zen"}

if LIB == "posttrain":
    import trl_alias

    trl_alias.install()


def _redirect_datasets() -> None:
    import datasets
    import datasets.load

    original = datasets.load.load_dataset

    def load_dataset(path, *args, **kwargs):
        local = LOCAL_DATASETS.get(path)
        return original(str(local) if local is not None else path, *args, **kwargs)

    load_dataset.__wrapped__ = original
    load_dataset.__doc__ = original.__doc__
    datasets.load_dataset = load_dataset
    datasets.load.load_dataset = load_dataset


_redirect_datasets()

# The suite is from TRL's repository after 1.16: its testing_utils.py imports availability helpers that TRL 1.16's
# trl.import_utils does not have yet. Only those are filled in, identically for both libraries, and only where the
# module under test lacks them (a helper TRL 1.16 has is never filled in: its absence is a real gap).
NEWER_THAN_TRL_1_16 = {"is_joblib_available": "joblib"}


def _fill_newer_helpers() -> None:
    import importlib.util

    try:
        import trl.import_utils as import_utils
    except ImportError:
        return
    for name, package in NEWER_THAN_TRL_1_16.items():
        if not hasattr(import_utils, name):
            setattr(import_utils, name, lambda package=package: importlib.util.find_spec(package) is not None)


_fill_newer_helpers()


# Newer test modules also import, at their top, names that TRL 1.16 does not have (private helpers added later), so a
# whole file would fail to import over one name that a few of its tests use. In `from trl... import a, b` executed by
# a test module, a name the library under test lacks becomes a placeholder that raises ImportError when used: the tests
# that use it fail, the others run. Both libraries get the same treatment; the names are recorded in the JSON output.
PLACEHOLDERS: dict[str, set[str]] = {}


class _Placeholder:
    def __init__(self, module: str, name: str):
        self._message = f"cannot import name {name!r} from {module!r} (harness placeholder: the library lacks it)"

    def __call__(self, *args, **kwargs):
        raise ImportError(self._message)

    def __getattr__(self, attr):
        if attr.startswith("__"):
            raise AttributeError(attr)
        raise ImportError(self._message)

    def __repr__(self):
        return f"<placeholder: {self._message}>"


class _TolerantModule(types.ModuleType):
    def __init__(self, real):
        super().__init__(real.__name__)
        object.__setattr__(self, "_real", real)

    def __getattr__(self, name):
        real = object.__getattribute__(self, "_real")
        try:
            return getattr(real, name)
        except AttributeError:
            if name.startswith("__"):
                raise
            return _Placeholder(real.__name__, name)


_real_import = builtins.__import__


def _tolerant_import(name, globals=None, locals=None, fromlist=(), level=0):
    module = _real_import(name, globals, locals, fromlist, level)
    if (
        fromlist
        and level == 0
        and (name == "trl" or name.startswith("trl."))
        and globals is not None
        and str(globals.get("__name__", "")).startswith("tests.")
    ):
        missing = [n for n in fromlist if n != "*" and not hasattr(module, n)]
        if missing:
            PLACEHOLDERS.setdefault(name, set()).update(missing)
            return _TolerantModule(module)
    return module


builtins.__import__ = _tolerant_import


def pytest_addoption(parser):
    group = parser.getgroup("trl_suite")
    group.addoption("--trl-sample", default="", help="FILE=K,...: keep every K-th test of FILE")
    group.addoption("--trl-select", default=None, help="keep only the node ids listed in this file")
    group.addoption("--trl-json", default=None, help="write the outcomes as JSON here")
    group.addoption("--trl-timeout", type=float, default=0, help="per-test time limit in seconds")


def _file_of(nodeid: str) -> str:
    return nodeid.split("::", 1)[0]


def pytest_collection_modifyitems(session, config, items):
    keep, drop = [], []
    select = config.getoption("--trl-select")
    if select:
        wanted = {line.strip() for line in Path(select).read_text().splitlines() if line.strip()}
        for item in items:
            (keep if item.nodeid in wanted else drop).append(item)
    else:
        every = {}
        for part in filter(None, config.getoption("--trl-sample").split(",")):
            name, k = part.split("=")
            every[name.strip()] = int(k)
        index: dict[str, int] = {}
        for item in items:
            path = _file_of(item.nodeid)
            name = path[len("tests/") :] if path.startswith("tests/") else path
            k = every.get(path) or every.get(name) or every.get(Path(path).name) or every.get("*") or 1
            i = index.get(path, 0)
            index[path] = i + 1
            (keep if i % k == 0 else drop).append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep


class _Timeout(Exception):
    pass


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item):
    limit = item.config.getoption("--trl-timeout")
    if not limit or not hasattr(signal, "SIGALRM"):
        yield
        return

    def on_alarm(signum, frame):
        raise _Timeout(f"test ran past the harness limit of {limit:.0f} s")

    previous = signal.signal(signal.SIGALRM, on_alarm)
    signal.setitimer(signal.ITIMER_REAL, limit)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


_RESULTS: dict[str, dict] = {}
_COLLECT_ERRORS: dict[str, str] = {}


def _first_error_line(report) -> str:
    longrepr = report.longrepr
    if longrepr is None:
        return ""
    crash = getattr(longrepr, "reprcrash", None)
    if crash is not None:
        return crash.message.splitlines()[0][:500] if crash.message else ""
    if isinstance(longrepr, tuple):  # skips: (path, line, reason)
        return str(longrepr[-1])[:500]
    text = str(longrepr).strip().splitlines()
    errors = [line for line in text if line.startswith("E ")]
    return (errors[-1] if errors else (text[-1] if text else ""))[:500]


def pytest_runtest_logreport(report):
    entry = _RESULTS.setdefault(report.nodeid, {"outcome": "passed", "duration": 0.0, "message": ""})
    entry["duration"] = round(entry["duration"] + report.duration, 2)
    if report.when == "call" and hasattr(report, "wasxfail"):
        entry["outcome"] = "xfailed" if report.skipped else "xpassed"
        return
    if report.skipped and entry["outcome"] == "passed":
        entry["outcome"], entry["message"] = "skipped", _first_error_line(report)
    elif report.failed:
        outcome = "failed" if report.when == "call" else "error"
        if entry["outcome"] in ("passed", "skipped"):
            entry["outcome"], entry["message"] = outcome, _first_error_line(report)


def pytest_collectreport(report):
    if report.failed:
        _COLLECT_ERRORS[report.nodeid] = _first_error_line(report)


def pytest_sessionfinish(session, exitstatus):
    path = session.config.getoption("--trl-json")
    if not path:
        return
    out = {
        "lib": LIB,
        "finished": time.strftime("%Y-%m-%d %H:%M:%S"),
        "python": sys.version.split()[0],
        "tests": _RESULTS,
        "collect_errors": _COLLECT_ERRORS,
        "placeholders": {module: sorted(names) for module, names in sorted(PLACEHOLDERS.items())},
    }
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(out, indent=1, sort_keys=True))
