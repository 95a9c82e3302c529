"""The end-of-run report's cost: `write_report` on one real run's log history, two versions of posttrain side by side.

    OMP_NUM_THREADS=1 python benchmarks/bench_report.py --before /path/to/older/checkout [--steps 20] [--repeats 3]

One tiny Reward run (the plain-script shape of bench_reward_script.py, `logging_steps=1`, `write_report=False`)
leaves its metrics.jsonl; then each repeat times, in a fresh interpreter per version (alternating before, after),
`write_report(dir, log_history)` exactly as `train()` ends it: torch, transformers and posttrain are already
imported, so what is timed is the report itself, plotting-library import included. Reported per version: wall and
CPU seconds per repeat, the number of plots, and whether matplotlib got imported.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
TIMED = """
import json, sys, time
import torch, transformers, posttrain
from posttrain.training.report import load_log_history, write_report
history = load_log_history(sys.argv[1])
wall, cpu = time.perf_counter(), time.process_time()
report = write_report(sys.argv[1], log_history=history, title="bench")
wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
plots = len([p for p in report.parent.glob("plot_*")])
print("RESULT " + json.dumps({"wall_s": wall, "cpu_s": cpu, "plots": plots, "matplotlib": "matplotlib" in sys.modules,
                              "posttrain": posttrain.__file__}))
"""


def make_run(root: Path, steps: int) -> Path:
    """A finished Reward run's output_dir with its metrics.jsonl (posttrain from this checkout)."""
    sys.path.insert(0, str(HERE))
    from bench_reward_script import conversational_rows, make_model
    from datasets import Dataset
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from posttrain import RewardConfig, RewardTrainer

    path = make_model(root, "qwen2", 32, 2)
    args = RewardConfig(
        output_dir=str(root / "run"),
        per_device_train_batch_size=8,
        max_length=128,
        learning_rate=1e-3,
        max_steps=steps,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        use_cpu=True,
        bf16=False,  # float32, as the published figures (bf16=None is autocast on a CPU too)
        disable_tqdm=True,
        write_report=False,
    )
    model = AutoModelForSequenceClassification.from_pretrained(path, num_labels=1)
    data = Dataset.from_list(conversational_rows())
    RewardTrainer(
        model=model, args=args, train_dataset=data, processing_class=AutoTokenizer.from_pretrained(path)
    ).train()
    return root / "run"


def timed(code_root: Path, run: Path, target: Path) -> dict:
    shutil.rmtree(target, ignore_errors=True)
    target.mkdir(parents=True)
    shutil.copy(run / "metrics.jsonl", target / "metrics.jsonl")
    env = {**os.environ, "PYTHONPATH": str(code_root), "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    command = [sys.executable, "-c", TIMED, str(target)]  # run from code_root: `-c` puts the cwd first on sys.path
    out = subprocess.run(command, capture_output=True, text=True, env=env, cwd=code_root)
    line = next((text for text in out.stdout.splitlines() if text.startswith("RESULT ")), None)
    if line is None:
        sys.exit(f"report with {code_root} failed:\n{out.stderr[-3000:]}")
    return json.loads(line[len("RESULT ") :])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--before", required=True, help="the checkout to compare against (its repository root)")
    parser.add_argument("--after", default=str(HERE.parent), help="default: this checkout")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="bench_report_"))
    run = make_run(root, args.steps)
    results: dict[str, list[dict]] = {"before": [], "after": []}
    for repeat in range(args.repeats):
        for name in results:
            results[name].append(timed(Path(getattr(args, name)), run, root / f"{name}{repeat}"))
    print(
        f"write_report on a {args.steps}-step Reward run's log history, {args.repeats} repeats; load {os.getloadavg()}"
    )
    for name, runs in results.items():
        walls = " ".join(f"{r['wall_s']:.3f}" for r in runs)
        cpus = " ".join(f"{r['cpu_s']:.3f}" for r in runs)
        print(
            f"{name:7} {runs[0]['posttrain']}: wall s {walls} | CPU s {cpus} | plots {runs[0]['plots']} | "
            f"matplotlib imported: {runs[0]['matplotlib']}"
        )


if __name__ == "__main__":
    main()
