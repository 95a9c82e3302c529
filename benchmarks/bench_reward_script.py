"""The Reward trainer as a plain TRL-API script runs it, TRL against posttrain (only the import differs).

    OMP_NUM_THREADS=1 python benchmarks/bench_reward_script.py [--family qwen2] [--steps 20] [--repeats 2]
        [--hidden 32 --layers 2] [--bf16 true|false|unset] [--json FILE] [--profile DIR]

`--bf16` is given to both libraries alike; unset, each follows its default, which is bf16 autocast on both (TRL 1.16
and, since 2026-12-07, posttrain resolve `bf16=None` to True on a CPU too).

The script shape (issue 45, item 5): a local tiny checkpoint loaded with
`AutoModelForSequenceClassification.from_pretrained(path, num_labels=1)` (a new, seeded score head), its tokenizer
passed in as `processing_class`, conversational preference rows (a user turn and an assistant answer of a few
sentences each), `max_length=128`, `learning_rate=1e-3`, batch 8, bf16 as `--bf16` says (unset: bf16 autocast, both
libraries' default on a CPU too; before 2026-12-07 posttrain's default on a CPU was float32, so the figures published
before then compare TRL in bf16 autocast with posttrain in float32), everything else at the library's defaults.

Each run is a fresh single-threaded interpreter; runs alternate posttrain, trl, posttrain, trl, ... Reported per
run: the steady step time (first step left out), the whole `trainer.train()` wall time, the construction time
(`RewardTrainer(...)`: tokenization included) and peak RSS. With `--profile DIR` one more run of each library
writes a cProfile of its `train()` there.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")
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

# oneDNN's kernel-cache capacities: unset, posttrain bounds them (posttrain/runtime/kernel_cache.py) and TRL keeps
# torch's default; 1024 each, given to both, is torch's default on both sides (posttrain before the bound)
KERNEL_CACHE_VARIABLES = ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "DNNL_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY")

SENTENCES = (
    "The sky is blue today.",
    "Cats like to sleep in the sun.",
    "One plus two equals three.",
    "The moon is bright at night.",
    "A good answer is short and clear.",
    "Birds fly over the green tree.",
    "Fish swim in the cold water.",
    "Why is the sun so hot?",
    "This is a bad answer.",
    "Seven and eight are numbers.",
)


def conversational_rows(n: int = 256, seed: int = 0) -> list[dict]:
    """Preference rows as chat messages: a user question of 1-3 sentences, two assistant answers of 2-5."""
    rng = random.Random(seed)

    def text(lo, hi):
        return " ".join(rng.choice(SENTENCES) for _ in range(rng.randint(lo, hi)))

    rows = []
    for _ in range(n):
        user = {"role": "user", "content": text(1, 3)}
        rows.append(
            {
                "chosen": [user, {"role": "assistant", "content": text(2, 5)}],
                "rejected": [user, {"role": "assistant", "content": text(2, 5)}],
            }
        )
    return rows


def _peak_rss_mb() -> float | None:
    """VmHWM: the process's peak resident memory so far (Linux), to attribute the peak to a phase."""
    try:
        with open("/proc/self/status") as status:
            return next(int(line.split()[1]) / 1024 for line in status if line.startswith("VmHWM"))
    except (OSError, StopIteration):
        return None


def worker(impl: str, path: str, steps: int, profile: str | None = None, bf16: str = "unset") -> dict:
    peaks = {"start": _peak_rss_mb()}
    import torch
    from datasets import Dataset
    from transformers import AutoModelForSequenceClassification, AutoTokenizer, TrainerCallback

    if impl == "posttrain":
        from posttrain import RewardConfig, RewardTrainer
    else:
        from trl import RewardConfig, RewardTrainer

    peaks["imported"] = _peak_rss_mb()
    torch.set_num_threads(1)
    times = []

    class Timer(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            times.append((time.perf_counter(), time.process_time()))
            if state.global_step == 1:
                peaks["step1"] = _peak_rss_mb()

    start = time.perf_counter()
    torch.manual_seed(0)
    model = AutoModelForSequenceClassification.from_pretrained(path, num_labels=1)
    tokenizer = AutoTokenizer.from_pretrained(path)
    peaks["model"] = _peak_rss_mb()
    args = RewardConfig(
        output_dir=str(Path(tempfile.gettempdir()) / f"bench_reward_script_{impl}"),
        per_device_train_batch_size=8,
        max_length=128,
        learning_rate=1e-3,
        max_steps=steps,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        use_cpu=True,
        disable_tqdm=True,
        **({} if bf16 == "unset" else {"bf16": bf16 == "true"}),
    )
    trainer = RewardTrainer(
        model=model,
        args=args,
        train_dataset=Dataset.from_list(conversational_rows()),
        processing_class=tokenizer,
        callbacks=[Timer()],
    )
    built, built_cpu = time.perf_counter(), time.process_time()
    peaks["built"] = _peak_rss_mb()
    if profile:
        import cProfile

        profiler = cProfile.Profile()
        profiler.enable()
    trainer.train()
    done, done_cpu = time.perf_counter(), time.process_time()
    peaks["trained"] = _peak_rss_mb()
    if profile:
        profiler.disable()
        profiler.dump_stats(str(Path(profile) / f"{impl}.prof"))
    lengths = [len(r["input_ids"]) for r in trainer.train_dataset] if "input_ids" in trainer.train_dataset[0] else []
    return {
        "step_ms": 1000 * (times[-1][0] - times[0][0]) / (len(times) - 1),
        "cpu_ms": 1000 * (times[-1][1] - times[0][1]) / (len(times) - 1),
        "train_s": done - built,
        "train_cpu_s": done_cpu - built_cpu,
        "build_s": built - start,
        "step0_loss": next(h["loss"] for h in trainer.state.log_history if "loss" in h),
        "mean_tokens": statistics.mean(lengths) if lengths else None,
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "peak_rss_mb_by_phase": peaks,
        "bf16": trainer.args.bf16,
        "process_cpu_s": time.process_time(),
    }


def make_model(root: Path, family: str, hidden: int, layers: int) -> str:
    from posttrain.models.tiny import save_tiny_model

    return save_tiny_model(root / family, seed=0, family=family, hidden_size=hidden, num_layers=layers)


def run(impl: str, path: str, steps: int, profile: str | None = None, bf16: str = "unset") -> dict:
    cmd = [sys.executable, __file__, "--worker", impl, path, "--steps", str(steps), "--bf16", bf16]
    cmd += ["--profile", profile] if profile else []
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    out = subprocess.run(cmd, capture_output=True, text=True, env=env)
    line = next((text for text in out.stdout.splitlines() if text.startswith("RESULT ")), None)
    if line is None:
        sys.exit(f"{impl} run failed:\n{out.stderr[-3000:]}")
    return json.loads(line[len("RESULT ") :])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--family", default="qwen2")
    parser.add_argument("--hidden", type=int, default=32)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--profile", help="also write one cProfile of each library's train() into this folder")
    parser.add_argument(
        "--bf16",
        choices=("true", "false", "unset"),
        default="unset",
        help="bf16 given to both libraries alike (unset: each library's default; TRL 1.16 resolves it to True)",
    )
    parser.add_argument("--json", help="also write every run, the settings, the commit and the load here")
    parser.add_argument("--worker", nargs=2, metavar=("IMPL", "PATH"))
    args = parser.parse_args()
    if args.worker:
        print("RESULT " + json.dumps(worker(*args.worker, args.steps, args.profile, args.bf16)))
        return
    load_before = os.getloadavg()
    root = Path(tempfile.mkdtemp(prefix="bench_reward_script_"))
    path = make_model(root, args.family, args.hidden, args.layers)
    results: dict[str, list[dict]] = {"posttrain": [], "trl": []}
    for _ in range(args.repeats):
        for impl in results:
            results[impl].append(run(impl, path, args.steps, bf16=args.bf16))
    print(
        f"Reward, plain TRL-API script: tiny {args.family} (hidden {args.hidden}, {args.layers} layers), batch 8, "
        f"max_length 128, {args.steps} steps, 1 thread, {args.repeats} alternating runs; load {os.getloadavg()}"
    )
    headers = ("step ms (wall)", 24), ("step ms (CPU)", 24), ("train() s", 24), ("build s", 18), ("peak RSS MB", 18)
    print(f"{'':10}" + "".join(f"{name:>{width}}" for name, width in headers) + f"{'step-0 loss':>14}")

    def cells(runs, key, fmt):
        return " ".join(format(r[key], fmt) for r in runs)

    for impl, runs in results.items():
        print(
            f"{impl:10}{cells(runs, 'step_ms', '7.1f'):>24}{cells(runs, 'cpu_ms', '7.1f'):>24}"
            f"{cells(runs, 'train_s', '7.2f'):>24}"
            f"{cells(runs, 'build_s', '6.2f'):>18}{cells(runs, 'peak_rss_mb', '6.0f'):>18}{runs[0]['step0_loss']:14.6f}"
        )
    for impl, runs in results.items():
        phases = " | ".join(
            f"{phase} " + "/".join(f"{r['peak_rss_mb_by_phase'].get(phase) or 0:.0f}" for r in runs)
            for phase in runs[0]["peak_rss_mb_by_phase"]
        )
        print(f"{impl} peak RSS MB by phase (each run): {phases}")
    ratios = [t["step_ms"] / p["step_ms"] for p, t in zip(results["posttrain"], results["trl"])]
    train = [t["train_s"] / p["train_s"] for p, t in zip(results["posttrain"], results["trl"])]
    train_cpu = [t["train_cpu_s"] / p["train_cpu_s"] for p, t in zip(results["posttrain"], results["trl"])]
    cpu = [t["cpu_ms"] / p["cpu_ms"] for p, t in zip(results["posttrain"], results["trl"])]
    print(f"speed ratio (TRL step / posttrain step), wall, per pair: {' '.join(f'{r:.2f}x' for r in ratios)}")
    print(f"speed ratio, CPU time, per pair: {' '.join(f'{r:.2f}x' for r in cpu)}")
    print(f"train() ratio, wall, per pair: {' '.join(f'{r:.2f}x' for r in train)}")
    print(f"train() ratio, CPU time, per pair: {' '.join(f'{r:.2f}x' for r in train_cpu)}")
    print(
        f"train() CPU s: posttrain {cells(results['posttrain'], 'train_cpu_s', '.3f')}; "
        f"trl {cells(results['trl'], 'train_cpu_s', '.3f')}"
    )
    whole = [t["process_cpu_s"] / p["process_cpu_s"] for p, t in zip(results["posttrain"], results["trl"])]
    print(f"whole script (process CPU, imports included) ratio per pair: {' '.join(f'{r:.2f}x' for r in whole)}")
    if args.json:
        from provenance import conditions

        record = {
            "conditions": {
                **conditions(),
                "load_average_before": [round(x, 2) for x in load_before],
                "load_average_after": [round(x, 2) for x in os.getloadavg()],
            },
            "settings": {
                **{k: getattr(args, k) for k in ("family", "hidden", "layers", "steps", "repeats", "bf16")},
                "POSTTRAIN_GC_FREEZE": os.environ.get("POSTTRAIN_GC_FREEZE", "1"),
                **{name: os.environ[name] for name in KERNEL_CACHE_VARIABLES if name in os.environ},
            },
            "runs": results,
            "ratios": {
                "step_cpu": cpu,
                "train_cpu": train_cpu,
                "step_wall": ratios,
                "train_wall": train,
                "process_cpu": whole,
            },
        }
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(record, indent=1) + "\n")
    if args.profile:
        Path(args.profile).mkdir(parents=True, exist_ok=True)
        for impl in results:
            run(impl, path, args.steps, args.profile, args.bf16)
        print(f"profiles in {args.profile}")


if __name__ == "__main__":
    main()
