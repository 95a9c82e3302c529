"""DPO with posttrain vs TRL on the same model, data and settings; prints a table.

    OMP_NUM_THREADS=1 python benchmarks/bench_dpo.py [--model tiny|smollm2] [--steps N] [--repeats 2]

Each run is its own subprocess (so peak RSS is per run), and the runs alternate posttrain, trl, posttrain,
trl, ... so that drift in machine load hits both alike. `tiny` (a Llama with hidden size 256, 4 layers, batch 8
pairs): both trainers get an explicit reference model that differs from the policy, which makes the step-0 loss a
real check of the formula and the tokenization (with the policy as its own reference, every implementation starts
at exactly log 2). `smollm2` (the built-in SmolLM2-135M-Instruct, batch 4 pairs, float32): `ref_model=None`, the
usual call, so each library keeps its own frozen copy of the policy.

Speed is per CPU second of the process (one thread: the wall time of an idle machine, without the turns other
jobs take on a shared one), between the ends of the first and the last step; wall-clock steps/s are shown too.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")  # before torch is imported
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import argparse
import json
import random
import resource
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from common import print_comparison, step_timer

WORDS = (
    "the a is of to and in on for with that this it what how why answer question yes no good bad red green "
    "blue one two three four five six seven eight nine ten cat dog bird fish sky sun moon tree"
).split()
SETTINGS = dict(
    beta=0.1,
    learning_rate=1e-5,
    max_length=256,
    seed=0,
    lr_scheduler_type="constant",
    logging_steps=1,
    save_strategy="no",
    report_to="none",
    use_cpu=True,
    disable_tqdm=True,
    gradient_checkpointing=False,
    bf16=False,
)


def synthetic_rows(n: int = 256, seed: int = 0) -> list[dict]:
    """Prompts of 20-60 words; chosen ends with ' good', rejected with ' bad', both 5-25 words long."""
    rng = random.Random(seed)

    def words(lo, hi):
        return " ".join(rng.choice(WORDS) for _ in range(rng.randint(lo, hi)))

    return [
        {"prompt": words(20, 60), "chosen": " " + words(5, 25) + " good", "rejected": " " + words(5, 25) + " bad"}
        for _ in range(n)
    ]


MODELS = {"tiny": dict(steps=30, batch=8), "smollm2": dict(steps=5, batch=4)}


def worker(impl: str, model_path: str, ref_path: str | None, steps: int, batch: int) -> dict:
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(1)
    rows = synthetic_rows()
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    model = AutoModelForCausalLM.from_pretrained(model_path)
    ref_model = AutoModelForCausalLM.from_pretrained(ref_path) if ref_path else None
    settings = dict(
        SETTINGS,
        output_dir=str(Path(tempfile.gettempdir()) / f"bench_dpo_{impl}"),
        max_steps=steps,
        per_device_train_batch_size=batch,
    )
    if impl == "posttrain":
        from posttrain.trainers.dpo import DPOConfig, DPOTrainer

        settings["max_prompt_length"] = None
    else:
        from trl import DPOConfig, DPOTrainer
    timer = step_timer()
    trainer = DPOTrainer(
        model,
        ref_model=ref_model,
        args=DPOConfig(**settings),
        train_dataset=Dataset.from_list(rows),
        processing_class=tokenizer,
        callbacks=[timer],
    )
    trainer.train()
    tokens_per_row = statistics.mean(
        2 * len(r["prompt_ids"]) + len(r["chosen_ids"]) + len(r["rejected_ids"]) for r in trainer.train_dataset
    )
    (wall_0, cpu_0), (wall_1, cpu_1) = timer.times[0], timer.times[-1]
    steps = len(timer.times) - 1
    return {
        "impl": impl,
        "steps_per_s": steps / (wall_1 - wall_0),
        "tokens_per_s": steps * batch * tokens_per_row / (cpu_1 - cpu_0),
        "tokens_per_step": batch * tokens_per_row,
        "cpu_ms_per_step": 1000 * (cpu_1 - cpu_0) / steps,
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "step0_loss": next(h["loss"] for h in trainer.state.log_history if "loss" in h),
        "first_rows": [
            {k: trainer.train_dataset[i][k] for k in ("prompt_ids", "chosen_ids", "rejected_ids")} for i in range(3)
        ],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=tuple(MODELS), default="tiny")
    parser.add_argument("--steps", type=int, help="Optimizer steps per run (default: 30 tiny, 5 smollm2).")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--worker", choices=("posttrain", "trl"))
    parser.add_argument("--model-path")
    parser.add_argument("--ref-path")
    parser.add_argument("--batch", type=int)
    args = parser.parse_args()
    steps, batch = args.steps or MODELS[args.model]["steps"], args.batch or MODELS[args.model]["batch"]
    if args.worker:
        print("RESULT " + json.dumps(worker(args.worker, args.model_path, args.ref_path, steps, batch)))
        return

    if args.model == "tiny":
        from posttrain.models.tiny import save_tiny_model

        root = Path(tempfile.mkdtemp(prefix="bench_dpo_"))
        paths = [
            "--model-path",
            save_tiny_model(root / "policy", seed=0, hidden_size=256, num_layers=4),
            "--ref-path",
            save_tiny_model(root / "ref", seed=1, hidden_size=256, num_layers=4),
        ]
        title = "DPO, tiny Llama (hidden 256, 4 layers), explicit reference"
    else:
        from posttrain.models.builtin import builtin_model_path

        paths = ["--model-path", builtin_model_path()]
        title = "DPO, SmolLM2-135M-Instruct (float32), ref_model=None"
    results: dict[str, list[dict]] = {"posttrain": [], "trl": []}
    for _ in range(args.repeats):
        for impl in ("posttrain", "trl"):
            cmd = [
                sys.executable,
                __file__,
                "--worker",
                impl,
                "--model",
                args.model,
                *paths,
                "--steps",
                str(steps),
                "--batch",
                str(batch),
            ]
            out = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
            line = next((text for text in out.stdout.splitlines() if text.startswith("RESULT ")), None)
            if line is None:
                sys.exit(f"{impl} run failed:\n{out.stderr[-3000:]}")
            results[impl].append(json.loads(line[len("RESULT ") :]))

    same_tokens = results["posttrain"][0]["first_rows"] == results["trl"][0]["first_rows"]
    title += (
        f", batch {batch} pairs, max_length {SETTINGS['max_length']}, {steps} steps, OMP_NUM_THREADS=1, "
        f"median of {args.repeats} alternating runs each (tokens/s per CPU second; load average "
        f"{os.getloadavg()[0]:.1f} at the end)"
    )
    rows = print_comparison(title, results)
    p, t = rows["posttrain"], rows["trl"]
    print(
        f"step-0 loss difference: {abs(p['step0_loss'] - t['step0_loss']):.2e}; "
        f"same token ids for the first rows: {same_tokens}"
    )


if __name__ == "__main__":
    main()
