"""Asynchronous generation (OnlineConfig.async_generation_rounds) against the synchronous loop: GRPO on the same
model, prompts, reward and settings, transformers backend on the CPU.

Settings, each a fresh process given the same cores (`--threads`, default: every physical core):
- sync: generate, then update, on all the threads;
- thread k=1: a background thread of the training process generates the next round (async_generation_process=False);
- process k=1: a generation process pinned to half the cores generates the next round, with in-flight weight
  updates; training is pinned to the rest (the default for k >= 1 on a CPU machine with 2 free cores).

The runs alternate between the settings, so that a change in machine load hits all alike. Reported: wall seconds
per optimizer step from the end of step `--warmup` to the end of the last step (start-up, the generation process's
included, is reported apart as "first steps"), its ratio to sync, and how long training waited for a round.

`--phases` measures the ceiling instead: each phase's time at 1 and 2 threads from synchronous runs (time/generation,
time/update, the rest of the step), the generation process's own round time (sampling plus its log-prob forward) and
the cost of publishing the weights, and the best step time the overlap permits: max(generation side, training side),
also from CPU seconds at one thread, which other jobs on a busy machine inflate less than wall time.

    python benchmarks/bench_async_generation.py --model smollm2 [--repeats 3] [--steps 12]
    python benchmarks/bench_async_generation.py --model smollm2 --phases
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from common import REPO_ROOT, run_isolated

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # as the tests: no tokenizer thread pool beside ours
SETTINGS = {
    "sync": dict(async_generation_rounds=None),
    "thread k=1": dict(async_generation_rounds=1, async_generation_process=False),
    "process k=1": dict(async_generation_rounds=1, async_generation_process=True),
}
TARGETS = frozenset({298, 299, 300, 301})
# The measurement: 2 prompts x 8 completions of up to 24 tokens per step.
SMOLLM2 = dict(per_device_train_batch_size=16, num_generations=8, max_completion_length=24, learning_rate=1e-5)


def target_tokens(completion_ids, **kwargs):
    return [sum(t in TARGETS for t in ids) / max(len(ids), 1) for ids in completion_ids]


def _task(model: str, folder: str):
    """(model, tokenizer, train dataset, reward, GRPO settings) of the tiny task or SmolLM2's arithmetic."""
    from datasets import Dataset
    from transformers import AutoTokenizer

    if model == "smollm2":
        sys.path.insert(0, str(REPO_ROOT / "examples"))
        import grpo_arithmetic

        from posttrain.models import load_causal_lm, load_tokenizer

        tokenizer = load_tokenizer(grpo_arithmetic.MODEL)
        return (
            load_causal_lm(grpo_arithmetic.MODEL),
            tokenizer,
            grpo_arithmetic.arithmetic_problems(2000, 0),
            grpo_arithmetic.numeric_accuracy,
            dict(SMOLLM2, max_prompt_length=128),
        )
    if model == "tiny":  # a tiny model big enough that generation and update both take visible time
        from posttrain.models.tiny import save_tiny_model

        model = save_tiny_model(f"{folder}/model", hidden_size=128)
    words = "cat dog sun moon tree fish bird sky".split()
    data = Dataset.from_list([{"prompt": f"{words[i % 8]} {i} and {words[(3 * i) % 8]}"} for i in range(256)])
    settings = dict(per_device_train_batch_size=16, num_generations=8, max_completion_length=32, learning_rate=1e-2)
    return model, AutoTokenizer.from_pretrained(model), data, target_tokens, settings


def run_one(setting: str, steps: int, model: str, warmup: int = 2, max_completion_length: int | None = None) -> dict:
    """One training run in this process; returns its timings."""
    import torch
    from transformers import TrainerCallback

    from posttrain.trainers.grpo import GRPOConfig, GRPOTrainer

    class StepClock(TrainerCallback):
        ends: list[float] = []

        def on_step_end(self, args, state, control, **kwargs):
            StepClock.ends.append(time.perf_counter())

    with tempfile.TemporaryDirectory() as folder:
        policy, tokenizer, data, reward, settings = _task(model, folder)
        if max_completion_length is not None:
            settings["max_completion_length"] = max_completion_length
        args = GRPOConfig(
            output_dir=folder,
            max_steps=steps,
            logging_steps=1,
            seed=0,
            use_cpu=True,
            bf16=False,  # float32, as the published figures (bf16=None is autocast on a CPU too since 2026-12-07)
            report_to="none",
            save_strategy="no",
            disable_tqdm=True,
            write_report=False,
            **settings,
            **SETTINGS[setting],
        )
        trainer = GRPOTrainer(policy, reward, args=args, train_dataset=data, processing_class=tokenizer)
        trainer.add_callback(StepClock())
        generation_cpu = _cpu_timed(trainer, "generate_episodes")  # the synchronous loop's phase 1
        start, cpu = time.perf_counter(), time.process_time()
        trainer.train()
        cpu = time.process_time() - cpu
    logs = trainer.state.log_history

    def median_of(key: str) -> float | None:
        values = [h[key] for h in logs if key in h]
        return statistics.median(values[warmup:] or values) if values else None

    ends = StepClock.ends
    return {
        "wall_per_step": (ends[-1] - ends[warmup - 1]) / (len(ends) - warmup),
        "first_steps_s": ends[warmup - 1] - start,
        "cpu_per_step": cpu / steps,
        "wait_per_step": median_of("perf/rollout_wait_s"),
        "generation_s": median_of("time/generation"),
        "update_s": median_of("time/update"),
        "process_round_s": median_of("time/async_generation"),
        "generation_cpu_s": statistics.median(generation_cpu[warmup:] or generation_cpu) if generation_cpu else None,
        "threads": torch.get_num_threads(),
    }


def _cpu_timed(trainer, method: str) -> list[float]:
    """Records the process CPU seconds of each call of `trainer.<method>` (at one thread: the phase's cost, which
    other jobs on the machine do not inflate the way they inflate wall time)."""
    seconds, original = [], getattr(trainer, method)

    def timed(*args, **kwargs):
        start = time.process_time()
        try:
            return original(*args, **kwargs)
        finally:
            seconds.append(time.process_time() - start)

    setattr(trainer, method, timed)
    return seconds


def publish_cost(model: str) -> dict:
    """Seconds to publish the policy's weights into a shared slot (the training side's cost per update)."""
    import torch

    from posttrain.models.reference import copy_model
    from posttrain.online.weights.shared_memory import SharedWeights

    with tempfile.TemporaryDirectory() as folder:
        policy = _task(model, folder)[0]
    if isinstance(policy, str):
        from transformers import AutoModelForCausalLM

        policy = AutoModelForCausalLM.from_pretrained(policy)
    weights = SharedWeights(copy_model(policy), 3, torch.multiprocessing.get_context("spawn"))
    params = list(policy.parameters())
    seconds = []
    for version in range(5):
        start = time.perf_counter()
        weights.publish(params, version, set())
        seconds.append(time.perf_counter() - start)
    return {"publish_s": statistics.median(seconds[1:])}


def _threads_env(threads: int) -> dict[str, str]:
    return {"OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}


def table(model: str, steps: int, repeats: int, threads: int) -> str:
    """The settings' runs, alternating, as a markdown table with its caption (machine load included)."""
    results: dict[str, list[dict]] = {name: [] for name in SETTINGS}
    load_before = _load()
    for repeat in range(repeats):
        for name in list(SETTINGS) if repeat % 2 == 0 else list(reversed(SETTINGS)):
            kwargs = dict(setting=name, steps=steps, model=model)
            results[name].append(run_isolated("bench_async_generation:run_one", kwargs, env=_threads_env(threads)))
            print(f"repeat {repeat + 1}: {name}: {json.dumps(results[name][-1])}", file=sys.stderr, flush=True)
    base = statistics.median(r["wall_per_step"] for r in results["sync"])
    lines = [
        f"GRPO {model}, {threads} cores per run, median of {repeats} alternating runs; load average {load_before} "
        f"before, {_load()} after",
        "",
        "| setting | wall s/step | steps/s | vs sync | wait s/step | first steps s | CPU s/step |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, runs in results.items():
        wall = statistics.median(r["wall_per_step"] for r in runs)
        waits = [r["wait_per_step"] for r in runs if r["wait_per_step"] is not None]
        wait = f"{statistics.median(waits):.3f}" if waits else "-"
        first = statistics.median(r["first_steps_s"] for r in runs)
        cpu = statistics.median(r["cpu_per_step"] for r in runs)
        lines.append(
            f"| {name} | {wall:.3f} | {1 / wall:.3f} | {base / wall:.2f}x | {wait} | {first:.1f} | {cpu:.3f} |"
        )
    return "\n".join(lines)


def phases(options) -> None:
    """Each phase at 1 and 2 threads, the generation process's round and the publish cost; the overlap's ceiling."""
    load_before = _load()
    sync = {}
    for threads in (1, 2):
        kwargs = dict(setting="sync", steps=options.steps, model=options.model)
        sync[threads] = run_isolated("bench_async_generation:run_one", kwargs, env=_threads_env(threads))
    process = run_isolated(
        "bench_async_generation:run_one",
        dict(setting="process k=1", steps=options.steps, model=options.model),
        env=_threads_env(2),
    )
    publish = run_isolated("bench_async_generation:publish_cost", dict(model=options.model), env=_threads_env(1))
    print(f"Phases of GRPO {options.model} (medians over steps); load average {load_before} before, {_load()} after")
    print("| phase | 1 thread s | 2 threads s |")
    print("|---|---|---|")
    rest = {t: sync[t]["wall_per_step"] - sync[t]["generation_s"] - sync[t]["update_s"] for t in (1, 2)}
    for label, values in (
        ("generation (time/generation)", {t: sync[t]["generation_s"] for t in (1, 2)}),
        ("update, forward + backward (time/update)", {t: sync[t]["update_s"] for t in (1, 2)}),
        ("rest of the step (scoring, optimizer, logging)", rest),
        ("whole synchronous step", {t: sync[t]["wall_per_step"] for t in (1, 2)}),
    ):
        print(f"| {label} | {values[1]:.3f} | {values[2]:.3f} |")
    generation_side = process["process_round_s"]
    training_side = sync[1]["update_s"] + rest[1] + publish["publish_s"]
    ceiling = max(generation_side, training_side)
    print(f"| generation process round (sampling, 1 core, wall) | {generation_side:.3f} | |")
    print(f"| publishing the weights (training side, per update) | {publish['publish_s']:.3f} | |")
    generation_cpu = sync[1]["generation_cpu_s"]
    training_cpu = sync[1]["cpu_per_step"] - generation_cpu + publish["publish_s"]
    print(f"| generation, CPU seconds at 1 thread | {generation_cpu:.3f} | |")
    print(f"| the rest of the step, CPU seconds at 1 thread (+ publishing) | {training_cpu:.3f} | |")
    print()
    sync_step = sync[2]["wall_per_step"]
    print(
        f"Best overlapped step on a 1 + 1 core split: max(generation side {generation_side:.3f}, training side "
        f"{training_side:.3f}) = {ceiling:.3f} s (in CPU time: max({generation_cpu:.3f}, {training_cpu:.3f})); "
        f"synchronous on 2 threads: {sync_step:.3f} s; ceiling {sync_step / ceiling:.2f}x (CPU-time bound "
        f"{sync_step / max(generation_cpu, training_cpu):.2f}x). Measured process k=1: {process['wall_per_step']:.3f} "
        f"s/step ({sync_step / process['wall_per_step']:.2f}x; one run, the table alternates runs for the ratio)."
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--model", default="tiny", help="tiny (a tiny Llama), smollm2, or a model path")
    parser.add_argument("--threads", type=int, default=None, help="cores per run (default: every physical core)")
    parser.add_argument("--phases", action="store_true", help="the ceiling analysis instead of the table")
    options = parser.parse_args()
    if options.threads is None:
        from posttrain.runtime.cores import free_cores

        options.threads = len(free_cores(0))
    if options.phases:
        phases(options)
    else:
        print(table(options.model, options.steps, options.repeats, options.threads))


def _load() -> str:
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


if __name__ == "__main__":
    main()
