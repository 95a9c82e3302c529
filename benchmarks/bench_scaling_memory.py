"""Memory per process under each engine: SFT and DPO for a few steps, 2 CPU processes per launch; prints a table.

    OMP_NUM_THREADS=1 python benchmarks/bench_scaling_memory.py [--models tiny,smollm2] [--trainers sft,dpo]
        [--engines one,ddp,fsdp2,zero2,zero3] [--steps 3]

Each (model, trainer, engine) is one `accelerate launch --config_file examples/accelerate_configs/<engine>.yaml`
of this file in worker mode, with the shipped config unchanged ("one" is the same worker in one plain process).
Every process trains with the same per-device batch (2 rows, 64 tokens at most) and AdamW, and records:
- peak RSS: its `ru_maxrss` at the end (the whole process: runtime, model loading, training);
- above runtime: that peak minus the resident size measured after the imports, before any model exists;
- the policy's and the reference's parameter elements it holds after training (sharded or whole).
The table shows the largest value over the ranks. Runs are sequential, so they never compete for memory.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")  # before torch is imported
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

import argparse
import json
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = ROOT / "examples" / "accelerate_configs"
WORDS = ["red", "green", "blue", "cat", "dog", "sun", "moon", "tree"]
PER_DEVICE = 2


def _rss_mb() -> float:
    with open("/proc/self/statm") as handle:
        return int(handle.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def worker(out_dir: str, model: str, trainer_name: str, steps: int) -> None:
    """Trains `trainer_name` on `model` in this process (under a launcher: one rank) and writes its numbers."""
    import torch  # noqa: F401  (the runtime is measured with torch, transformers and posttrain imported)
    from datasets import Dataset

    import posttrain as pt
    from posttrain.runtime.distributed import held_parameter_count

    runtime_mb = _rss_mb()
    common = dict(
        output_dir=os.path.join(out_dir, "run"),
        per_device_train_batch_size=PER_DEVICE,
        max_steps=steps,
        learning_rate=1e-5,
        logging_steps=1,
        seed=0,
        report_to="none",
        save_strategy="no",
        disable_tqdm=True,
        write_report=False,
        max_length=64,
        bf16=False,  # float32, as the published figures (bf16=None is autocast on a CPU too)
    )
    if trainer_name == "sft":
        rows = [
            {"prompt": f"say {WORDS[i % 8]} {i}", "completion": " " + " ".join(WORDS[: 1 + (5 * i) % 8])}
            for i in range(32)
        ]
        trainer = pt.SFTTrainer(model, args=pt.SFTConfig(**common), train_dataset=Dataset.from_list(rows))
    elif trainer_name == "dpo":
        rows = [
            {
                "prompt": f"name {WORDS[i % 8]} {i}",
                "chosen": " " + " ".join(WORDS[: 1 + i % 5]),
                "rejected": " " + " ".join(WORDS[::-1][: 1 + (3 * i) % 7]),
            }
            for i in range(32)
        ]
        trainer = pt.DPOTrainer(model, args=pt.DPOConfig(**common), train_dataset=Dataset.from_list(rows))
    else:
        raise ValueError(trainer_name)
    start = time.perf_counter()
    trainer.train()
    result = {
        "world_size": trainer.accelerator.num_processes,
        "distributed_type": str(trainer.accelerator.distributed_type),
        "runtime_mb": runtime_mb,
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "train_s": time.perf_counter() - start,
        "policy_held": held_parameter_count(trainer.model_wrapped),
    }
    if getattr(trainer, "ref_model", None) is not None:
        result["ref_held"] = held_parameter_count(trainer.ref_model)
    rank = int(os.environ.get("RANK", "0"))
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(result))


def _model_path(name: str, tmp: Path) -> str:
    if name == "tiny":
        from posttrain.models.tiny import save_tiny_model

        return str(save_tiny_model(tmp / "tiny"))
    if name == "smollm2":
        from posttrain.models.builtin import builtin_model_path

        return builtin_model_path()
    return name  # a path or hub id


def measure(model: str, trainer_name: str, engine: str, steps: int, tmp: Path) -> list[dict]:
    out = Path(tempfile.mkdtemp(dir=tmp, prefix=f"{trainer_name}_{engine}_"))
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
    }
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p))
    work = [__file__, "--worker", str(out), model, trainer_name, str(steps)]
    if engine == "one":
        command = [sys.executable, *work]
    else:
        command = [
            sys.executable,
            "-m",
            "accelerate.commands.launch",
            "--config_file",
            str(CONFIGS / f"{engine}.yaml"),
            "--main_process_port",
            "0",
            *work,
        ]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=1800)
    if done.returncode != 0:
        raise RuntimeError(f"{trainer_name} under {engine} failed:\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}")
    return [json.loads(p.read_text()) for p in sorted(out.glob("rank*.json"))]


def _held(pair) -> str:
    """ "50% of 134.5M": the share of the model's parameter elements this process holds."""
    if pair is None:
        return "-"
    held, full = pair
    size = f"{full / 1e6:.1f}M" if full >= 1e5 else f"{full / 1e3:.1f}k"
    return f"{100 * held / full:.0f}% of {size}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", default="tiny,smollm2")
    parser.add_argument("--trainers", default="sft,dpo")
    parser.add_argument("--engines", default="one,ddp,fsdp2,zero2,zero3")
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()
    print(
        "| model | trainer | engine | processes | peak RSS per process (MB) | above runtime (MB) | "
        "policy params held | reference params held | train s |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory(prefix="bench_scaling_") as tmp:
        for model_name in args.models.split(","):
            model = _model_path(model_name, Path(tmp))
            for trainer_name in args.trainers.split(","):
                for engine in args.engines.split(","):
                    ranks = measure(model, trainer_name, engine, args.steps, Path(tmp))
                    worst = max(ranks, key=lambda r: r["peak_rss_mb"])
                    above = max(r["peak_rss_mb"] - r["runtime_mb"] for r in ranks)
                    print(
                        f"| {model_name} | {trainer_name} | {engine} | {worst['world_size']} | "
                        f"{worst['peak_rss_mb']:.0f} | {above:.0f} | {_held(worst['policy_held'])} | "
                        f"{_held(worst.get('ref_held'))} | {max(r['train_s'] for r in ranks):.1f} |",
                        flush=True,
                    )
    print(f"load average: {os.getloadavg()}")


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        worker(sys.argv[2], sys.argv[3], sys.argv[4], int(sys.argv[5]))
    else:
        main()
