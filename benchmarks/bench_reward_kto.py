"""Reward modelling and KTO with posttrain vs TRL on the same tiny model, data and settings; prints two tables.

    OMP_NUM_THREADS=1 python benchmarks/bench_reward_kto.py [--steps 30] [--repeats 2] [--methods reward kto]

Each run is its own subprocess (so peak RSS is per run), and the runs alternate posttrain, trl, posttrain,
trl, ... so that drift in machine load hits both alike. Both reward trainers start from one saved
classifier checkpoint (the same score head), and both KTO trainers get an explicit reference model that
differs from the policy, so the step-0 losses check the formulas and the tokenization. Batches are taken
in dataset order (train_sampling_strategy="sequential"), so step 0 sees the same rows in both.
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
    per_device_train_batch_size=8,
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
    train_sampling_strategy="sequential",
)
METHOD_SETTINGS = {"reward": dict(learning_rate=1e-4), "kto": dict(learning_rate=1e-5, beta=0.1)}
MODEL = dict(hidden_size=256, num_layers=4)


def preference_rows(n: int = 256, seed: int = 0) -> list[dict]:
    """Prompts of 20-60 words; chosen ends with ' good', rejected with ' bad', both 5-25 words long. Completions
    start with a space, so prompt and completion tokenize the same apart as joined."""
    rng = random.Random(seed)

    def words(lo, hi):
        return " ".join(rng.choice(WORDS) for _ in range(rng.randint(lo, hi)))

    return [
        {"prompt": words(20, 60), "chosen": " " + words(5, 25) + " good", "rejected": " " + words(5, 25) + " bad"}
        for _ in range(n)
    ]


def unpaired_rows(rows: int | None = None) -> list[dict]:
    """The preference rows as unpaired KTO rows, desirable and undesirable alternating (the first `rows`)."""
    return [
        {"prompt": r["prompt"], "completion": r[column], "label": column == "chosen"}
        for r in preference_rows(128)
        for column in ("chosen", "rejected")
    ][:rows]


def sequences(method: str, tokenizer, rows: int | None = None) -> list[list[int]]:
    """The token sequences a step trains on, per row: prompt + completion + EOS (counted the same for both)."""

    def ids(prompt, completion):
        return tokenizer(prompt + completion)["input_ids"] + [tokenizer.eos_token_id]

    if method == "reward":
        return [ids(r["prompt"], r["chosen"]) + ids(r["prompt"], r["rejected"]) for r in preference_rows()]
    return [ids(r["prompt"], r["completion"]) for r in unpaired_rows(rows)]


def worker(impl: str, method: str, root: str, steps: int, rows: int | None = None) -> dict:
    """One run. `rows` (KTO): train on the first `rows` rows only, so that the run goes over them epoch after epoch
    (posttrain then reuses each row's reference log-probs from its first epoch: `cache_ref_log_probs`)."""
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer

    torch.set_num_threads(1)
    root = Path(root)
    tokenizer = AutoTokenizer.from_pretrained(root / "policy")
    settings = dict(
        SETTINGS,
        **METHOD_SETTINGS[method],
        max_steps=steps,
        output_dir=str(Path(tempfile.gettempdir()) / f"bench_{method}_{impl}"),
    )
    timer = step_timer()
    if method == "reward":
        if impl == "posttrain":
            from posttrain import RewardConfig, RewardTrainer
        else:
            from trl import RewardConfig, RewardTrainer
        model = AutoModelForSequenceClassification.from_pretrained(root / "classifier")
        trainer = RewardTrainer(
            model,
            args=RewardConfig(**settings),
            train_dataset=Dataset.from_list(preference_rows()),
            processing_class=tokenizer,
            callbacks=[timer],
        )
    else:
        if impl == "posttrain":
            from posttrain import KTOConfig, KTOTrainer
        else:
            from trl import KTOConfig, KTOTrainer
        model = AutoModelForCausalLM.from_pretrained(root / "policy")
        ref_model = AutoModelForCausalLM.from_pretrained(root / "ref")
        trainer = KTOTrainer(
            model,
            ref_model=ref_model,
            args=KTOConfig(**settings),
            train_dataset=Dataset.from_list(unpaired_rows(rows)),
            processing_class=tokenizer,
            callbacks=[timer],
        )
    trainer.train()
    tokens_per_row = statistics.mean(map(len, sequences(method, tokenizer, rows)))
    (wall_0, cpu_0), (wall_1, cpu_1) = timer.times[0], timer.times[-1]
    timed = len(timer.times) - 1
    steps_per_s = timed / (wall_1 - wall_0)
    return {
        "steps_per_s": steps_per_s,
        "tokens_per_s": steps_per_s * SETTINGS["per_device_train_batch_size"] * tokens_per_row,
        "tokens_per_step": SETTINGS["per_device_train_batch_size"] * tokens_per_row,
        "cpu_ms_per_step": 1000 * (cpu_1 - cpu_0) / timed,
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "step0_loss": next(h["loss"] for h in trainer.state.log_history if "loss" in h),
    }


def make_models(root: Path, family: str = "llama", **config_settings) -> None:
    """The policy, a differently seeded reference, and a classifier made from the policy with a seeded head (tiny
    models of `family`, with `config_settings`)."""
    import torch
    from transformers import AutoModelForSequenceClassification

    from posttrain.models.tiny import save_tiny_model

    policy = save_tiny_model(root / "policy", seed=0, family=family, **MODEL, **config_settings)
    save_tiny_model(root / "ref", seed=1, family=family, **MODEL, **config_settings)
    torch.manual_seed(0)
    classifier = AutoModelForSequenceClassification.from_pretrained(policy, num_labels=1)
    classifier.save_pretrained(root / "classifier")


def print_table(method: str, results: dict[str, list[dict]], args) -> None:
    title = (
        f"\n{method}: tiny Llama (hidden {MODEL['hidden_size']}, {MODEL['num_layers']} layers), batch "
        f"{SETTINGS['per_device_train_batch_size']}, {args.steps} steps, OMP_NUM_THREADS=1, median of "
        f"{args.repeats} alternating runs each"
    )
    p, t = (print_comparison(title, results)[impl] for impl in ("posttrain", "trl"))
    print(f"step-0 loss difference: {abs(p['step0_loss'] - t['step0_loss']):.2e}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--methods", nargs="+", choices=("reward", "kto"), default=["reward", "kto"])
    parser.add_argument("--rows", type=int, help="KTO: train on the first ROWS rows (several epochs) instead of 256.")
    parser.add_argument("--worker", nargs=3, metavar=("IMPL", "METHOD", "ROOT"))
    args = parser.parse_args()
    if args.worker:
        print("RESULT " + json.dumps(worker(*args.worker, args.steps, args.rows)))
        return

    root = Path(tempfile.mkdtemp(prefix="bench_reward_kto_"))
    make_models(root)
    for method in args.methods:
        results: dict[str, list[dict]] = {"posttrain": [], "trl": []}
        for _ in range(args.repeats):
            for impl in results:
                cmd = [sys.executable, __file__, "--worker", impl, method, str(root), "--steps", str(args.steps)]
                cmd += ["--rows", str(args.rows)] if args.rows else []
                out = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
                line = next((text for text in out.stdout.splitlines() if text.startswith("RESULT ")), None)
                if line is None:
                    sys.exit(f"{impl} {method} run failed:\n{out.stderr[-3000:]}")
                results[impl].append(json.loads(line[len("RESULT ") :]))
        print_table(method, results, args)


if __name__ == "__main__":
    main()
