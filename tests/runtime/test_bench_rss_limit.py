"""benchmarks/common.py's resident-memory ceiling: on a machine shared with other jobs, a benchmark run that would
not fit is killed at the ceiling (and said so) instead of getting another job OOM-killed; a run under it returns
its result as an unwatched run does."""

import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
from common import RSSExceeded, run_isolated  # noqa: E402

# The child imports this module by name: its folder, the repository and benchmarks/ on its path.
CHILD_PATH = {"PYTHONPATH": ":".join(str(p) for p in (Path(__file__).parent, ROOT, ROOT / "benchmarks"))}


def hold(mb: int, seconds: float) -> dict:
    """Touches `mb` MB and keeps them resident for `seconds` (the child's workload)."""
    block = bytearray(mb << 20)
    block[::4096] = b"x" * len(block[::4096])
    time.sleep(seconds)
    return {"held_mb": len(block) >> 20}


def test_a_run_past_the_ceiling_is_killed_and_named():
    started = time.perf_counter()
    with pytest.raises(RSSExceeded, match="exceeded") as caught:
        run_isolated(
            "test_bench_rss_limit:hold", {"mb": 400, "seconds": 30}, rss_limit_mb=200, timeout=60, env=CHILD_PATH
        )
    assert caught.value.seen_mb > 200
    assert time.perf_counter() - started < 20  # killed while holding, not after the 30 s sleep


def test_a_run_under_the_ceiling_returns_its_result():
    result = run_isolated(
        "test_bench_rss_limit:hold", {"mb": 64, "seconds": 0.5}, rss_limit_mb=4000, timeout=60, env=CHILD_PATH
    )
    assert result["held_mb"] == 64
    assert result["peak_rss_mb"] >= 64
