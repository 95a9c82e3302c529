"""GRPO and RLOO in posttrain against TRL on the same tiny model, prompts, reward and settings (CPU).

Each run is a fresh process (so that peak RSS is its own), and the runs alternate between the libraries
so that a change in machine load hits both alike. Generation time is the whole generation call: TRL's
`model.generate` on the policy object, posttrain's generation backend (which decodes with its own loop);
everything else of the training wall time is counted as update (forward, backward, optimizer, rewards,
bookkeeping). Steps per second are timed from the end of the first step to the end of the last, in wall time and
in process CPU time (on a machine shared with other jobs steps per CPU-second is the figure that measures the
code), as the offline benchmarks time their steps: what `train()` does once before its first step (both
libraries' Trainer runs a full `gc.collect()` there, 0.3-0.4 s) is no step's cost. `run_steps_per_s` is the
whole `train()` call's rate, start-up included.

    OMP_NUM_THREADS=1 python benchmarks/bench_grpo.py [--repeats 3] [--steps 20] [--baseline REV]

`--baseline REV` adds posttrain as of git revision REV (checked out in a temporary worktree) as a third library,
for before/after numbers of an engine change.
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

LIBRARIES = ("posttrain", "trl")
METHODS = ("grpo", "rloo")
TARGETS = frozenset({298, 299, 300, 301})  # tokens of the tiny tokenizer the reward asks for


def target_tokens(completion_ids, **kwargs):
    """The fraction of a completion's tokens in TARGETS."""
    return [sum(t in TARGETS for t in ids) / max(len(ids), 1) for ids in completion_ids]


def settings(method: str, output_dir: str, steps: int) -> dict:
    """The settings both libraries are given (the names are the same in both)."""
    return dict(
        output_dir=output_dir,
        max_steps=steps,
        per_device_train_batch_size=16,
        num_generations=8,
        max_completion_length=16,
        learning_rate=1e-2,
        temperature=1.0,
        beta=0.05 if method == "rloo" else 0.0,
        logging_steps=1,
        seed=0,
        use_cpu=True,
        bf16=False,
        report_to="none",
        save_strategy="no",
        disable_tqdm=True,
    )


def timed_generate(owner, totals: dict, count) -> None:
    """Wraps `owner.generate` to add its wall time and its number of generated tokens (`count(args, kwargs,
    output)`) to `totals`."""
    generate = owner.generate

    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        output = generate(*args, **kwargs)
        totals["generation_s"] += time.perf_counter() - start
        totals["tokens"] += count(args, kwargs, output)
        return output

    owner.generate = wrapper


def generated_tokens(pad_token_id: int):
    """Counts `model.generate`'s new tokens (what follows the prompt, padding excluded)."""

    def count(args, kwargs, output):
        prompt_width = (kwargs.get("input_ids") if "input_ids" in kwargs else args[0]).shape[1]
        return int((output[:, prompt_width:] != pad_token_id).sum())

    return count


def run_one(library: str, method: str, model_path: str, steps: int) -> dict:
    """Trains one configuration in this process and returns its measurements."""
    from common import step_timer
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if library.startswith("posttrain"):  # "posttrain@REV" imports the worktree first on PYTHONPATH
        from posttrain import GRPOConfig, GRPOTrainer, RLOOConfig, RLOOTrainer
    else:
        from trl import GRPOConfig, GRPOTrainer, RLOOConfig, RLOOTrainer
    config_class, trainer_class = (GRPOConfig, GRPOTrainer) if method == "grpo" else (RLOOConfig, RLOOTrainer)

    tokenizer = AutoTokenizer.from_pretrained(model_path)
    model = AutoModelForCausalLM.from_pretrained(model_path)
    totals = {"generation_s": 0.0, "tokens": 0}
    words = ["cat", "dog", "sun", "moon", "tree", "fish", "bird", "sky"]
    data = Dataset.from_list([{"prompt": f"{words[i % 8]} {i} and {words[(3 * i) % 8]}"} for i in range(256)])
    with tempfile.TemporaryDirectory() as output_dir:
        extra = {"write_report": False} if library.startswith("posttrain") else {}  # TRL writes no report
        args = config_class(**settings(method, output_dir, steps), **extra)
        trainer = trainer_class(
            model=model, reward_funcs=target_tokens, args=args, train_dataset=data, processing_class=tokenizer
        )
        if library.startswith("posttrain") and hasattr(trainer, "generation_backend"):
            # posttrain's backend decodes with its own loop (no `model.generate`): time the backend's call
            timed_generate(
                trainer.generation_backend,
                totals,
                lambda args, kwargs, completions: sum(len(c.token_ids) for c in completions),
            )
        else:
            timed_generate(model, totals, generated_tokens(tokenizer.pad_token_id))
        timer = step_timer()
        trainer.add_callback(timer)
        start = time.perf_counter()
        trainer.train()
        wall = time.perf_counter() - start
    rewards = [h["reward"] for h in trainer.state.log_history if "reward" in h]
    source = sys.modules[trainer_class.__module__].__file__
    (first_wall, first_cpu), (last_wall, last_cpu) = timer.times[0], timer.times[-1]
    steps_per_s = (steps - 1) / (last_wall - first_wall)
    return {
        "source": source,
        "library": library,
        "method": method,
        "wall_s": wall,
        "steps_per_s": steps_per_s,
        "steps_per_cpu_s": (steps - 1) / (last_cpu - first_cpu),
        "run_steps_per_s": steps / wall,
        "tokens_per_step": totals["tokens"] / steps,
        "tokens_per_s": totals["tokens"] / steps * steps_per_s,
        "generation_s": totals["generation_s"],
        "update_s": wall - totals["generation_s"],
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "first_reward": statistics.mean(rewards[:3]),
        "last_reward": statistics.mean(rewards[-3:]),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--baseline", help="also run posttrain at this git revision")
    parser.add_argument("--worker", nargs=3, metavar=("LIBRARY", "METHOD", "MODEL_PATH"), help=argparse.SUPPRESS)
    options = parser.parse_args()
    if options.worker:
        print(json.dumps(run_one(*options.worker, steps=options.steps)))
        return

    from posttrain.models.tiny import save_tiny_model

    env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1")
    results: dict[tuple[str, str], list[dict]] = {}
    libraries = LIBRARIES + ((f"posttrain@{options.baseline}",) if options.baseline else ())
    with tempfile.TemporaryDirectory() as directory:
        model_path = save_tiny_model(os.path.join(directory, "tiny"))
        envs = {library: env for library in libraries}
        if options.baseline:
            worktree = os.path.join(directory, "baseline")
            repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
            subprocess.run(
                ["git", "-C", repo, "worktree", "add", "--detach", worktree, options.baseline],
                check=True,
                capture_output=True,
            )
            envs[libraries[-1]] = dict(env, PYTHONPATH=worktree)
        for repeat in range(options.repeats):
            for method in METHODS:
                for library in libraries if repeat % 2 == 0 else reversed(libraries):
                    command = [
                        sys.executable,
                        __file__,
                        "--steps",
                        str(options.steps),
                        "--worker",
                        library,
                        method,
                        model_path,
                    ]
                    done = subprocess.run(command, env=envs[library], capture_output=True, text=True, check=True)
                    result = json.loads(done.stdout.strip().splitlines()[-1])
                    if library != "trl":
                        print(f"  ({library} from {result['source']})", flush=True)
                    results.setdefault((library, method), []).append(result)
                    print(
                        f"run {repeat + 1}: {library} {method}: {result['steps_per_s']:.2f} steps/s, "
                        f"{result['steps_per_cpu_s']:.2f} steps/CPU-s",
                        flush=True,
                    )

    columns = {
        "steps_per_s": ".2f",
        "steps_per_cpu_s": ".2f",
        "run_steps_per_s": ".2f",
        "tokens_per_s": ".0f",
        "peak_rss_mb": ".0f",
        "generation_s": ".2f",
        "update_s": ".2f",
        "first_reward": ".3f",
        "last_reward": ".3f",
    }
    print(
        f"\nmedians over {options.repeats} runs of {options.steps} steps (tiny Llama, 16 completions of <= 16 "
        "tokens per step, OMP_NUM_THREADS=1)"
    )
    print("| method | library | " + " | ".join(columns) + " |")
    print("|---|---|" + "---|" * len(columns))
    if options.baseline:
        subprocess.run(["git", "worktree", "prune"], cwd=os.path.dirname(os.path.abspath(__file__)), check=False)
    for method in METHODS:
        for library in libraries:
            runs = results[(library, method)]
            cells = [format(statistics.median(r[c] for r in runs), spec) for c, spec in columns.items()]
            print(f"| {method} | {library} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
