"""Start-up time of the `posttrain` command: `--version`, `sft --help` and `env`, median of 5 runs each, one thread.

`sft --help` is timed twice: once with an empty flag-spec cache (the first run after an install or an edit, which
imports the trainer to read its config) and then warm (every later run, answered from the cache without torch).

    .venv/bin/python benchmarks/bench_cli_start.py [--runs 5]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SCRIPT = Path(sys.executable).parent / "posttrain"
COMMAND = [str(SCRIPT)] if SCRIPT.exists() else [sys.executable, "-m", "posttrain"]
COMMANDS = (["--version"], ["sft", "--help"], ["env"])


def run_once(argv: list[str], env: dict[str, str]) -> float:
    started = time.perf_counter()
    subprocess.run(COMMAND + argv, env=env, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as cache:
        env = {
            **os.environ,
            "OMP_NUM_THREADS": "1",
            "MKL_NUM_THREADS": "1",
            "TOKENIZERS_PARALLELISM": "false",
            "POSTTRAIN_CACHE": cache,
        }
        rows = [("sft --help (cold: empty cache)", run_once(["sft", "--help"], env))]
        for argv in COMMANDS:
            times = [run_once(argv, env) for _ in range(args.runs)]
            rows.append((" ".join(argv), statistics.median(times)))
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(
        f"posttrain start-up, median of {args.runs} (cold: 1 run), one thread, {os.cpu_count()} CPUs, "
        f"load average {load:.1f}"
    )
    print(f"{'command':<42} {'seconds':>8}")
    for name, seconds in rows:
        print(f"{'posttrain ' + name:<42} {seconds:>8.2f}")


if __name__ == "__main__":
    main()
