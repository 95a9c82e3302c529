"""Asynchronous generation (OnlineConfig.async_generation_rounds) against the synchronous loop: GRPO on the same
model, prompts, reward and settings, transformers backend on the CPU.

Each run is a fresh process and the runs alternate between the settings, so that a change in machine load hits
all alike. The synchronous loop generates and updates in turn on one thread; with k rounds ahead a background
thread generates the next rounds while the current one updates, so with one intra-op thread each
(OMP_NUM_THREADS=1) the two can use two cores. Reported: wall seconds per optimizer step (median over runs), the
process CPU seconds per step, how long training waited for a round (perf/rollout_wait_s), and the wall-time
ratio to the synchronous loop. TRL's asynchronous GRPO needs a vLLM server and has no transformers path, so it
is not in the table.

    OMP_NUM_THREADS=1 python benchmarks/bench_async_generation.py [--repeats 3] [--steps 12] [--model PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # as the tests: no tokenizer thread pool beside ours
SETTINGS = {"sync": None, "async k=1": 1, "async k=2": 2}
TARGETS = frozenset({298, 299, 300, 301})


def target_tokens(completion_ids, **kwargs):
    return [sum(t in TARGETS for t in ids) / max(len(ids), 1) for ids in completion_ids]


def run_one(rounds: int | None, steps: int, model: str | None) -> dict:
    """One training run in this process; returns its timings."""
    from datasets import Dataset
    from transformers import AutoTokenizer

    from posttrain.trainers.grpo import GRPOConfig, GRPOTrainer

    with tempfile.TemporaryDirectory() as folder:
        if model is None:  # a tiny model big enough that generation and update both take visible time
            from posttrain.models.tiny import save_tiny_model

            model = save_tiny_model(f"{folder}/model", hidden_size=128)
        tokenizer = AutoTokenizer.from_pretrained(model)
        words = "cat dog sun moon tree fish bird sky".split()
        data = Dataset.from_list([{"prompt": f"{words[i % 8]} {i} and {words[(3 * i) % 8]}"} for i in range(256)])
        args = GRPOConfig(
            output_dir=folder,
            max_steps=steps,
            per_device_train_batch_size=16,
            num_generations=8,
            max_completion_length=32,
            learning_rate=1e-2,
            logging_steps=1,
            seed=0,
            use_cpu=True,
            report_to="none",
            save_strategy="no",
            disable_tqdm=True,
            write_report=False,
            async_generation_rounds=rounds,
        )
        trainer = GRPOTrainer(model, target_tokens, args=args, train_dataset=data, processing_class=tokenizer)
        cpu, start = time.process_time(), time.perf_counter()
        trainer.train()
        wall, cpu = time.perf_counter() - start, time.process_time() - cpu
        waits = [h["perf/rollout_wait_s"] for h in trainer.state.log_history if "perf/rollout_wait_s" in h]
        return {
            "wall_per_step": wall / steps,
            "cpu_per_step": cpu / steps,
            "wait_per_step": sum(waits) / len(waits) if waits else None,
            "rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--model", default=None, help="a model path (default: a tiny Llama, hidden size 128)")
    parser.add_argument("--one", default=None, help=argparse.SUPPRESS)  # a single run, in a child process
    options = parser.parse_args()
    if options.one is not None:
        print(json.dumps(run_one(json.loads(options.one), options.steps, options.model)))
        return
    results: dict[str, list[dict]] = {name: [] for name in SETTINGS}
    for repeat in range(options.repeats):
        for name, rounds in SETTINGS.items():
            command = [sys.executable, __file__, "--one", json.dumps(rounds), "--steps", str(options.steps)]
            if options.model:
                command += ["--model", options.model]
            output = subprocess.run(command, check=True, capture_output=True, text=True).stdout
            results[name].append(json.loads(output.strip().splitlines()[-1]))
            print(f"repeat {repeat + 1}: {name}: {results[name][-1]}", file=sys.stderr)
    base = statistics.median(r["wall_per_step"] for r in results["sync"])
    print(f"| setting | wall s/step | CPU s/step | wait s/step | vs sync (wall) |  (load: {_load()})")
    print("|---|---|---|---|---|")
    for name, runs in results.items():
        wall = statistics.median(r["wall_per_step"] for r in runs)
        cpu = statistics.median(r["cpu_per_step"] for r in runs)
        waits = [r["wait_per_step"] for r in runs if r["wait_per_step"] is not None]
        wait = f"{statistics.median(waits):.3f}" if waits else "-"
        print(f"| {name} | {wall:.3f} | {cpu:.3f} | {wait} | {base / wall:.2f}x |")


def _load() -> str:
    with open("/proc/loadavg") as f:
        return " ".join(f.read().split()[:3])


if __name__ == "__main__":
    main()
