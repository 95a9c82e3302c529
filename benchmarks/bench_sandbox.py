"""Throughput of the code-execution sandbox: snippets per second with bubblewrap and with the process fallback.

    python benchmarks/bench_sandbox.py [--snippets 32] [--workers 1 2] [--repeats 2]

A GRPO step on code scores many short completions; each one is a fresh interpreter in a fresh sandbox. Three
workloads per sandbox: `pass` (the start-up cost alone), the code_execution_reward harness on a correct solution
with three tests (what a training step pays), and the same with `import numpy` (a heavier import). The sandboxes
alternate run by run so that drift in machine load hits both alike; the table reports the best repeat.
"""

from __future__ import annotations

import argparse
import sys
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from posttrain.rewards import get_code_execution_reward, run_many  # noqa: E402
from posttrain.rewards.sandbox import sandbox_backend  # noqa: E402

SOLUTION = "```python\ndef f(x):\n    return x + 1\n```"
NUMPY_SOLUTION = "```python\nimport numpy as np\ndef f(x):\n    return int(np.int64(x) + 1)\n```"
TESTS = ["assert f(1) == 2", "assert f(2) == 3", "assert f(-1) == 0"]


def measure(workload: str, sandbox: str, snippets: int, workers: int) -> float:
    """Snippets per second for one batch of `snippets`."""
    start = time.perf_counter()
    if workload == "pass":
        results = run_many(["pass"] * snippets, max_workers=workers, sandbox=sandbox)
        assert all(result.ok for result in results), results[0]
    else:
        solution = SOLUTION if workload == "reward" else NUMPY_SOLUTION
        reward = get_code_execution_reward(max_workers=workers, sandbox=sandbox)
        scores = reward(completions=[solution] * snippets, tests=[TESTS] * snippets)
        assert scores == [1.0] * snippets, scores
    return snippets / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--snippets", type=int, default=32)
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    warnings.filterwarnings("ignore", message=".*weaker 'process' sandbox")
    backend = sandbox_backend()
    sandboxes = ["bubblewrap", "process"] if backend.startswith("bubblewrap") else ["process"]
    print(f"sandbox backend: {backend}; {args.snippets} snippets per batch, best of {args.repeats}")
    print(f"| workload | workers | {' | '.join(f'{name} (snippets/s)' for name in sandboxes)} | overhead |")
    print("|---|---|" + "---|" * len(sandboxes) + "---|")
    for workload in ("pass", "reward", "reward+numpy"):
        for workers in args.workers:
            best = {name: 0.0 for name in sandboxes}
            for _ in range(args.repeats):
                for name in sandboxes:
                    best[name] = max(best[name], measure(workload, name, args.snippets, workers))
            cells = " | ".join(f"{best[name]:.1f}" for name in sandboxes)
            overhead = (
                f"{(best['process'] / best['bubblewrap'] - 1) * 100:+.0f}% time" if len(sandboxes) == 2 else "n/a"
            )
            print(f"| {workload} | {workers} | {cells} | {overhead} |", flush=True)


if __name__ == "__main__":
    main()
