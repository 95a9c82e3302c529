"""posttrain against an earlier posttrain: the tiny cells of bench_table.py, run from two checkouts, alternating.

    python benchmarks/bench_commits.py BEFORE_DIR [AFTER_DIR] [--only sft,reward,kto,dpo,grpo,rloo] [--repeats 3]

BEFORE_DIR and AFTER_DIR (default: this checkout) are checkouts of the repository, e.g. `git worktree add
/tmp/before <commit>`. Each run builds bench_table's tiny Llama cells inside the checkout's own benchmarks/ with
that checkout's posttrain on the path, and times posttrain's cell only (CPU time, one thread, a fresh interpreter per
run: bench_table's method). The two checkouts alternate run by run; each cell reports the median steps/s of each
and their ratio, so a refactor that should change nothing shows ratios within run-to-run noise.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

from common import REPO_ROOT, print_table

# Run inside a checkout's benchmarks/ directory: prints {cell label: steps/s} for posttrain's tiny cells.
CHILD = """
import inspect, json, sys, tempfile
from pathlib import Path
import bench_table
only = set(sys.argv[1].split(","))
with tempfile.TemporaryDirectory(prefix="bench_commits_") as tmp:
    settings = dict(only=only, families=["llama"], smollm2=False, qwen3_smollm2=False, workdir=Path(tmp), peak=1.0,
                    steps_scale=1.0)
    accepted = inspect.signature(bench_table.benchmarks).parameters  # the tiny Llama cells, in either version
    cells = bench_table.benchmarks(**{k: v for k, v in settings.items() if k in accepted})
    print(json.dumps({f"{name} ({setting})": runs["posttrain"]()["steps_per_s"] for name, setting, runs in cells}))
"""


def run_checkout(checkout: Path, only: str) -> dict[str, float]:
    env = dict(os.environ, PYTHONPATH=str(checkout))
    done = subprocess.run(
        [sys.executable, "-c", CHILD, only],
        cwd=checkout / "benchmarks",
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )
    if done.returncode != 0:
        raise RuntimeError(f"{checkout} failed:\n{done.stderr[-4000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("before", type=Path, help="Checkout of the earlier commit.")
    parser.add_argument("after", type=Path, nargs="?", default=REPO_ROOT, help="Checkout of the later commit.")
    parser.add_argument("--only", default="sft,reward,kto,dpo,grpo,rloo", help="bench_table trainers to run.")
    parser.add_argument("--repeats", type=int, default=3, help="Runs per checkout (alternating); median.")
    args = parser.parse_args()
    runs: dict[str, dict[str, list[float]]] = {"before": {}, "after": {}}
    for _ in range(args.repeats):
        for side in ("before", "after"):
            for cell, rate in run_checkout(getattr(args, side).resolve(), args.only).items():
                runs[side].setdefault(cell, []).append(rate)
    rows = []
    for cell, before in runs["before"].items():
        after = runs["after"].get(cell)
        if after:
            b, a = statistics.median(before), statistics.median(after)
            rows.append([cell, b, a, a / b, f"{min(after) / max(before):.3f}-{max(after) / min(before):.3f}"])
    print_table(
        ["cell", "before steps/s", "after steps/s", "after/before", "range of ratios"],
        rows,
        title=f"posttrain {args.before} -> {args.after}, {args.repeats} alternating runs each (CPU time, 1 thread)",
    )


if __name__ == "__main__":
    main()
