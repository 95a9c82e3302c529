"""DPO with posttrain vs TRL on the same tiny model, data and settings; prints a table.

    OMP_NUM_THREADS=1 python benchmarks/bench_dpo.py [--steps 30] [--repeats 2]

Each run is its own subprocess (so peak RSS is per run), and the runs alternate posttrain, trl, posttrain,
trl, ... so that drift in machine load hits both alike. Both trainers get an explicit reference model that
differs from the policy, which makes the step-0 loss a real check of the formula and the tokenization
(with the policy as its own reference, every implementation starts at exactly log 2).
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
import time
from pathlib import Path

from common import print_comparison, step_timer

WORDS = ("the a is of to and in on for with that this it what how why answer question yes no good bad red green "
         "blue one two three four five six seven eight nine ten cat dog bird fish sky sun moon tree").split()
SETTINGS = dict(beta=0.1, learning_rate=1e-5, per_device_train_batch_size=8, max_length=256, seed=0,
                lr_scheduler_type="constant", logging_steps=1, save_strategy="no", report_to="none",
                use_cpu=True, disable_tqdm=True, gradient_checkpointing=False, bf16=False)


def synthetic_rows(n: int = 256, seed: int = 0) -> list[dict]:
    """Prompts of 20-60 words; chosen ends with ' good', rejected with ' bad', both 5-25 words long."""
    rng = random.Random(seed)

    def words(lo, hi):
        return " ".join(rng.choice(WORDS) for _ in range(rng.randint(lo, hi)))

    return [{"prompt": words(20, 60), "chosen": " " + words(5, 25) + " good", "rejected": " " + words(5, 25) + " bad"}
            for _ in range(n)]


def worker(impl: str, model_path: str, ref_path: str, steps: int) -> dict:
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(1)
    rows = synthetic_rows()
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    model = AutoModelForCausalLM.from_pretrained(model_path)
    ref_model = AutoModelForCausalLM.from_pretrained(ref_path)
    settings = dict(SETTINGS, output_dir=str(Path(tempfile.gettempdir()) / f"bench_dpo_{impl}"), max_steps=steps)
    if impl == "posttrain":
        from posttrain.trainers.dpo import DPOConfig, DPOTrainer

        settings["max_prompt_length"] = None
    else:
        from trl import DPOConfig, DPOTrainer
    timer = step_timer()
    trainer = DPOTrainer(model, ref_model=ref_model, args=DPOConfig(**settings), train_dataset=Dataset.from_list(rows),
                         processing_class=tokenizer, callbacks=[timer])
    trainer.train()
    tokens_per_row = statistics.mean(2 * len(r["prompt_ids"]) + len(r["chosen_ids"]) + len(r["rejected_ids"])
                                     for r in trainer.train_dataset)
    (wall_0, cpu_0), (wall_1, cpu_1) = timer.times[0], timer.times[-1]
    steps = len(timer.times) - 1
    steps_per_s = steps / (wall_1 - wall_0)
    return {
        "impl": impl,
        "steps_per_s": steps_per_s,
        "tokens_per_s": steps_per_s * SETTINGS["per_device_train_batch_size"] * tokens_per_row,
        "cpu_ms_per_step": 1000 * (cpu_1 - cpu_0) / steps,
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "step0_loss": next(h["loss"] for h in trainer.state.log_history if "loss" in h),
        "first_rows": [{k: trainer.train_dataset[i][k] for k in ("prompt_ids", "chosen_ids", "rejected_ids")}
                       for i in range(3)],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--worker", choices=("posttrain", "trl"))
    parser.add_argument("--model")
    parser.add_argument("--ref")
    args = parser.parse_args()
    if args.worker:
        print("RESULT " + json.dumps(worker(args.worker, args.model, args.ref, args.steps)))
        return

    from posttrain.models.tiny import save_tiny_model

    root = Path(tempfile.mkdtemp(prefix="bench_dpo_"))
    model = save_tiny_model(root / "policy", seed=0, hidden_size=256, num_layers=4)
    ref = save_tiny_model(root / "ref", seed=1, hidden_size=256, num_layers=4)
    results: dict[str, list[dict]] = {"posttrain": [], "trl": []}
    for _ in range(args.repeats):
        for impl in ("posttrain", "trl"):
            cmd = [sys.executable, __file__, "--worker", impl, "--model", model, "--ref", ref,
                   "--steps", str(args.steps)]
            out = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
            line = next((l for l in out.stdout.splitlines() if l.startswith("RESULT ")), None)
            if line is None:
                sys.exit(f"{impl} run failed:\n{out.stderr[-3000:]}")
            results[impl].append(json.loads(line[len("RESULT "):]))

    same_tokens = results["posttrain"][0]["first_rows"] == results["trl"][0]["first_rows"]
    title = (f"DPO, tiny Llama (hidden 256, 4 layers), batch {SETTINGS['per_device_train_batch_size']}, "
             f"{args.steps} steps, OMP_NUM_THREADS=1, median of {args.repeats} alternating runs each")
    p, t = (print_comparison(title, results)[impl] for impl in ("posttrain", "trl"))
    print(f"step-0 loss difference: {abs(p['step0_loss'] - t['step0_loss']):.2e}; "
          f"same token ids for the first rows: {same_tokens}")


if __name__ == "__main__":
    main()
