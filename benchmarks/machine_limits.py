"""The machine's limits, measured in torch: float32 matmul GFLOP/s at 1 and 2 threads, and copy bandwidth.

    python benchmarks/machine_limits.py [--repeats 20]     # writes docs/results/scaling/machine.json

Each measurement runs in a fresh interpreter with the thread count set before torch is imported. A limit is the
best of `--repeats` tries (the least disturbed by other jobs): a matmul of two 1024 x 1024 float32 matrices
(2 x 1024^3 FLOPs), timed in wall time and, at 1 thread, in process CPU time too; a copy of a 256 MiB float32
tensor into another (read + write: 512 MiB moved per copy), in wall and process CPU time. At 1 thread the
CPU-time figures are what the core does while it runs (the benchmarks time their steps the same way); at 2 threads
CPU time adds both threads', so only the wall figures count there. On a machine shared with other jobs
(the record keeps the load average) the figures are lower bounds of the idle machine's.

benchmarks/bench_scaling.py divides by these: MFU = model FLOPs per second / matmul peak at the run's thread
count; the decode bound of generation = the larger of (weight + KV-cache bytes per decode step / bandwidth) and
(2 x parameters x batch FLOPs / matmul peak).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import time

from common import REPO_ROOT, run_isolated

RESULTS = REPO_ROOT / "docs" / "results" / "scaling"


def matmul(size: int = 1024, repeats: int = 20) -> dict:
    import torch

    a, b = torch.randn(size, size), torch.randn(size, size)
    out = torch.empty(size, size)
    torch.mm(a, b, out=out)
    best_wall = best_cpu = float("inf")
    for _ in range(repeats):
        wall, cpu = time.perf_counter(), time.process_time()
        torch.mm(a, b, out=out)
        best_wall = min(best_wall, time.perf_counter() - wall)
        best_cpu = min(best_cpu, time.process_time() - cpu)
    flops = 2 * size**3
    threads = torch.get_num_threads()
    return {"threads": threads, "gflops_wall": flops / best_wall / 1e9, "gflops_cpu": flops / best_cpu / 1e9}


def copy_bandwidth(mib: int = 256, repeats: int = 10) -> dict:
    import torch

    src = torch.randn(mib * 2**20 // 4)
    dst = torch.empty_like(src)
    dst.copy_(src)
    best_wall = best_cpu = float("inf")
    for _ in range(repeats):
        wall, cpu = time.perf_counter(), time.process_time()
        dst.copy_(src)
        best_wall = min(best_wall, time.perf_counter() - wall)
        best_cpu = min(best_cpu, time.process_time() - cpu)
    moved = 2 * src.numel() * 4
    threads = torch.get_num_threads()
    return {"threads": threads, "gb_per_s": moved / best_wall / 1e9, "gb_per_s_cpu": moved / best_cpu / 1e9}


def measure(repeats: int) -> dict:
    record = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "loadavg_before": os.getloadavg(),
        "cpus": os.cpu_count(),
    }
    for threads in (1, 2):
        env = {"OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}
        record[f"matmul_{threads}"] = run_isolated("machine_limits:matmul", {"repeats": repeats}, env=env)
        record[f"copy_{threads}"] = run_isolated("machine_limits:copy_bandwidth", {"repeats": repeats}, env=env)
    record["loadavg_after"] = os.getloadavg()
    return record


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    record = measure(args.repeats)
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "machine.json").write_text(json.dumps(record, indent=1) + "\n")
    for threads in (1, 2):
        m, c = record[f"matmul_{threads}"], record[f"copy_{threads}"]
        print(
            f"{threads} thread(s): matmul {m['gflops_wall']:.1f} GFLOP/s (wall; CPU-time {m['gflops_cpu']:.1f}), "
            f"copy {c['gb_per_s']:.1f} GB/s (wall; CPU-time {c['gb_per_s_cpu']:.1f})"
        )
    print(f"load average before {record['loadavg_before']}, after {record['loadavg_after']} (LOADED machine)")


if __name__ == "__main__":
    main()
