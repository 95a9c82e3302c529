"""Shared benchmark plumbing: isolated single-threaded runs, a measured matmul peak, table printing.

Every measurement runs in a fresh interpreter with `OMP_NUM_THREADS=1` (and MKL's equivalent) set
*before* torch is imported, so that runs do not share allocator state, caches or thread pools, and
so that timings on a machine shared with other jobs are not dominated by thread oversubscription.
A run is named by "module:function" (module relative to `benchmarks/` or importable); it returns a
JSON-serialisable dict, to which the child adds its own peak resident memory.
"""

from __future__ import annotations

import importlib
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from provenance import conditions

BENCH_DIR = Path(__file__).resolve().parent
REPO_ROOT = BENCH_DIR.parent
TCMALLOC_CANDIDATES = (
    "/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4",
    "/usr/lib/aarch64-linux-gnu/libtcmalloc_minimal.so.4",
    "/usr/lib/libtcmalloc_minimal.so.4",
)


def single_thread_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """The current environment with one compute thread, offline Hugging Face, plus `extra`."""
    env = dict(os.environ)
    env.update(
        OMP_NUM_THREADS="1",
        MKL_NUM_THREADS="1",
        TOKENIZERS_PARALLELISM="false",
        HF_HUB_OFFLINE="1",
        HF_DATASETS_OFFLINE="1",
        PYTHONPATH=os.pathsep.join(p for p in (str(REPO_ROOT), str(BENCH_DIR), env.get("PYTHONPATH")) if p),
    )
    env.update(extra or {})
    return env


def tcmalloc_path() -> str | None:
    """The installed tcmalloc (Debian: `apt-get install libtcmalloc-minimal4`) for LD_PRELOAD, or None."""
    return next((p for p in TCMALLOC_CANDIDATES if os.path.exists(p)), None)


def run_isolated(
    target: str,
    kwargs: dict[str, Any] | None = None,
    *,
    env: dict[str, str] | None = None,
    timeout: float | None = None,
    rss_limit_mb: float | None = None,
) -> dict[str, Any]:
    """Calls `target` ("module:function") with `kwargs` in a fresh single-threaded interpreter.

    Returns the function's dict result plus `peak_rss_mb` (the child's maximum resident set size) and
    `wall_s` (the whole child, imports included). `env` adds variables, e.g. LD_PRELOAD. With `rss_limit_mb`
    the child is killed as soon as its resident memory passes the limit (RSSExceeded): on a machine shared
    with other jobs a run that would not fit must not get someone else's process OOM-killed.
    """
    with tempfile.TemporaryDirectory(prefix="bench_") as tmp:
        out = Path(tmp) / "result.json"
        command = [sys.executable, str(Path(__file__).resolve()), target, json.dumps(kwargs or {}), str(out)]
        start = time.perf_counter()
        if rss_limit_mb is None:
            done = subprocess.run(command, env=single_thread_env(env), capture_output=True, text=True, timeout=timeout)
        else:
            done = _run_watched(command, single_thread_env(env), timeout, rss_limit_mb)
        if done.returncode != 0 or not out.exists():
            raise RuntimeError(
                f"{target} failed (exit {done.returncode}):\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}"
            )
        result = json.loads(out.read_text())
    result["wall_s"] = time.perf_counter() - start
    result.setdefault("conditions", conditions())  # the commit measured, the time, the machine's load
    return result


class RSSExceeded(RuntimeError):
    """A watched run passed its resident-memory ceiling and was killed (`seen_mb`: the last reading)."""

    def __init__(self, limit_mb: float, seen_mb: float) -> None:
        super().__init__(f"exceeded {limit_mb / 1024:g} GB (killed at {seen_mb / 1024:.2f} GB resident)")
        self.limit_mb, self.seen_mb = limit_mb, seen_mb


def _resident_mb(pid: int) -> float:
    """The process's current resident set (VmRSS) in MB; 0 once it has gone."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


def _run_watched(command: list[str], env: dict, timeout: float | None, limit_mb: float):
    """`subprocess.run`, reading the child's resident memory every 0.2 s and killing it past `limit_mb`."""
    with tempfile.TemporaryFile("w+") as stdout, tempfile.TemporaryFile("w+") as stderr:
        child = subprocess.Popen(command, env=env, stdout=stdout, stderr=stderr, text=True)
        began = time.perf_counter()
        while child.poll() is None:
            seen = _resident_mb(child.pid)
            if seen > limit_mb:
                child.kill()
                child.wait()
                raise RSSExceeded(limit_mb, seen)
            if timeout is not None and time.perf_counter() - began > timeout:
                child.kill()
                child.wait()
                raise subprocess.TimeoutExpired(command, timeout)
            time.sleep(0.2)
        stdout.seek(0), stderr.seek(0)
        return subprocess.CompletedProcess(command, child.returncode, stdout.read(), stderr.read())


def _child_main(target: str, kwargs_json: str, out_path: str) -> None:
    module_name, function_name = target.split(":")
    function = getattr(importlib.import_module(module_name), function_name)
    result = dict(function(**json.loads(kwargs_json)))
    # ru_maxrss is in kilobytes on Linux.
    result["peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    Path(out_path).write_text(json.dumps(result))


def matmul_peak_flops(size: int = 1024, repeats: int = 20, dtype: str = "float32") -> dict[str, float]:
    """Best observed FLOP/s of a square `size` matmul in this process (run it through `run_isolated`
    for the single-thread peak). Timed in process CPU time, like the benchmarks, so that other jobs
    on the machine do not count; the best of many repeats estimates what the core can do, which is
    the right denominator for model FLOP utilisation."""
    import torch

    a = torch.randn(size, size, dtype=getattr(torch, dtype))
    b = torch.randn(size, size, dtype=getattr(torch, dtype))
    out = torch.empty(size, size, dtype=a.dtype)
    torch.mm(a, b, out=out)  # warm up
    best = float("inf")
    for _ in range(repeats):
        start = time.process_time()
        torch.mm(a, b, out=out)
        best = min(best, time.process_time() - start)
    return {"flops": 2 * size**3 / best, "threads": torch.get_num_threads()}


def format_table(headers: list[str], rows: list[list[Any]]) -> str:
    """A plain-text table: floats with 4 significant digits, columns right-aligned except the first."""

    def cell(value: Any) -> str:
        if isinstance(value, float):
            return f"{value:.4g}" if abs(value) < 1e5 else f"{value:,.0f}"
        return "" if value is None else str(value)

    cells = [headers] + [[cell(v) for v in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]

    def line(row: list[str]) -> str:
        return "  ".join(v.ljust(w) if i == 0 else v.rjust(w) for i, (v, w) in enumerate(zip(row, widths)))

    rule = "  ".join("-" * w for w in widths)
    return "\n".join([line(cells[0]), rule, *(line(r) for r in cells[1:])])


def print_table(headers: list[str], rows: list[list[Any]], title: str | None = None) -> None:
    if title:
        print(title)
    print(format_table(headers, rows), flush=True)


if __name__ == "__main__":
    _child_main(*sys.argv[1:4])


def step_timer():
    """A transformers callback that records (wall, CPU) seconds at each optimizer step's end.

    Throughput is measured between the first and the last step, so the first (warm-up) step is left out.
    """
    from transformers import TrainerCallback

    class StepTimer(TrainerCallback):
        def __init__(self):
            self.times: list[tuple[float, float]] = []

        def on_step_end(self, args, state, control, **kwargs):
            self.times.append((time.perf_counter(), time.process_time()))

    return StepTimer()


COMPARISON_KEYS = ("steps_per_s", "tokens_per_s", "cpu_ms_per_step", "peak_rss_mb", "step0_loss")


def print_comparison(title: str, results: dict[str, list[dict]]) -> dict[str, dict[str, float]]:
    """Prints posttrain vs TRL (median of each library's runs) with their ratio; returns the medians."""
    import statistics

    rows = {
        impl: {key: statistics.median(r[key] for r in runs) for key in COMPARISON_KEYS}
        for impl, runs in results.items()
    }
    print(title)
    print(f"{'':12}{'steps/s':>10}{'tokens/s':>12}{'CPU ms/step':>14}{'peak RSS MB':>14}{'step-0 loss':>16}")
    for impl, r in rows.items():
        print(
            f"{impl:12}{r['steps_per_s']:10.2f}{r['tokens_per_s']:12.0f}{r['cpu_ms_per_step']:14.0f}"
            f"{r['peak_rss_mb']:14.0f}{r['step0_loss']:16.8f}"
        )
    p, t = rows["posttrain"], rows["trl"]
    print(
        f"{'ratio p/t':12}{p['steps_per_s'] / t['steps_per_s']:10.2f}{p['tokens_per_s'] / t['tokens_per_s']:12.2f}"
        f"{p['cpu_ms_per_step'] / t['cpu_ms_per_step']:14.2f}{p['peak_rss_mb'] / t['peak_rss_mb']:14.2f}"
    )
    return rows
