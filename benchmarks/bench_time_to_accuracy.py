"""Held-out accuracy against training time: GRPO on SmolLM2-135M-Instruct with reasoning-gym 2-term arithmetic,
posttrain and TRL 1.16 on one identical configuration.

Both libraries get the same model, training problems, reward (examples/grpo_arithmetic.py), seed and GRPO
settings, by the same TRL names. Every `--eval_every` optimizer steps (and before the first) the model is scored
on the same `--eval_size` fixed held-out problems with greedy decoding, by the same code for both (posttrain's
transformers backend, top-k 1): the evaluation is the measuring instrument, and its time is taken off the
training clock. Each side runs in a fresh interpreter (benchmarks/common.py) with `--threads` compute threads
(default 1); with `--repeats` the order alternates and repeat r trains with seed `--seed` + r (one run per side is
mostly sampling luck: its completions decide the curve), and the table adds each library's mean curve over its
runs (accuracy and clocks averaged step by step) with its first +10 points; with `--parallel` the sides of a repeat
run at once, one core each. The clock is reported twice: wall seconds, and the process's CPU seconds, which is what
the code costs when other jobs share the machine (wall time then measures the neighbours too; the asynchronous
side's CPU clock counts its training process only). Both sides run with tcmalloc preloaded, as the `posttrain`
command runs (`--allocator system` for glibc malloc).

Asynchronous generation: the side `posttrain-async` is posttrain with async_generation_rounds=1 in a generation
process on its own core(s) (in-flight weight updates; online/process_rollouts.py). `--threads N` gives every run N
compute threads (the synchronous sides use them all; the asynchronous side splits them between the two
processes). While an evaluation runs, the generation process is stopped (SIGSTOP, SIGCONT after), so that it gains
no sampling time off the clock. The issue's comparison on this 2-core machine:

    python benchmarks/bench_time_to_accuracy.py --threads 2 --sides posttrain posttrain-async trl --repeats 3 \
        --steps 80 --eval_every 10 --eval_size 200 --label async

Levers (posttrain only; TRL has no equivalent) make an ablation one command per row, e.g.

    OMP_NUM_THREADS=1 python benchmarks/bench_time_to_accuracy.py --sides posttrain --label no-shared-prefill \
        --no_shared_prefill --output_dir outputs/tta

    --dynamic_sampling      DAPO dynamic sampling (zero-variance groups regenerated, `--max_num_gen_batches`)
    --no_shared_prefill     every completion prefills its own copy of the prompt (as `generate` does)
    --no_drop_finished      finished completions stay in the decode batch until the last one ends
    --no_shared_prompt_forward  the log-prob forward and backward run every completion with its own copy of the
                            prompt (the padded batch) instead of each group's prompt once

Outputs, in `--output_dir`: points.csv (one row per evaluation, appended to across commands), table.md (the
side-by-side summary of this command) and accuracy.png (accuracy against minutes, every curve in points.csv).
The full comparison on a quiet machine:

    OMP_NUM_THREADS=1 python benchmarks/bench_time_to_accuracy.py --steps 80 --eval_every 10 --eval_size 200
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import os
import signal
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from common import REPO_ROOT, run_isolated, tcmalloc_path

MODEL = "builtin:SmolLM2-135M-Instruct"
FIELDS = ("label", "library", "repeat", "step", "train_wall_s", "train_cpu_s", "accuracy")


def _example():
    """examples/grpo_arithmetic.py: the problems, the reward and the held-out evaluation."""
    sys.path.insert(0, str(REPO_ROOT / "examples"))
    import grpo_arithmetic

    return grpo_arithmetic


def accuracy_tracker(evaluate, eval_every: int, paused=contextlib.nullcontext):
    """A callback that evaluates at step 0 and every `eval_every` optimizer steps, and keeps the training clock
    (wall and CPU seconds since training began, evaluations excluded); `paused()` holds background work (a
    generation process) still while an evaluation runs."""
    from transformers import TrainerCallback

    class AccuracyTracker(TrainerCallback):
        def __init__(self):
            self.points: list[dict] = []
            self.eval_wall = self.eval_cpu = 0.0

        def measure(self, step: int, model) -> None:
            wall, cpu = time.perf_counter(), time.process_time()
            train_wall, train_cpu = wall - self.start_wall - self.eval_wall, cpu - self.start_cpu - self.eval_cpu
            with paused():
                accuracy = evaluate(model)
            self.points.append(
                {"step": step, "train_wall_s": train_wall, "train_cpu_s": train_cpu, "accuracy": accuracy}
            )
            self.eval_wall += time.perf_counter() - wall
            self.eval_cpu += time.process_time() - cpu
            print(
                f"step {step}: accuracy {accuracy:.3f} after {train_wall:.0f} s wall / {train_cpu:.0f} s CPU of "
                "training",
                file=sys.stderr,
                flush=True,
            )

        def on_train_begin(self, args, state, control, model=None, **kwargs):
            self.start_wall, self.start_cpu = time.perf_counter(), time.process_time()
            self.measure(0, model)

        def on_step_end(self, args, state, control, model=None, **kwargs):
            if state.global_step % eval_every == 0 or state.global_step == state.max_steps:
                self.measure(state.global_step, model)

    return AccuracyTracker()


def run_side(library: str, settings: dict, eval_size: int, eval_every: int, train_size: int, levers: dict) -> dict:
    """Trains one side in this process; returns its evaluation points and generation statistics."""
    import torch

    from posttrain.models import load_causal_lm, load_tokenizer

    example = _example()
    if library == "trl":
        from trl import GRPOConfig, GRPOTrainer
    else:
        from posttrain import GRPOConfig, GRPOTrainer
    trainer = None
    tokenizer = load_tokenizer(MODEL)
    model = load_causal_lm(MODEL)
    held_out = example.arithmetic_problems(eval_size, seed=1234)

    def evaluate(policy) -> float:
        was_training = policy.training
        try:
            return example.held_out_accuracy(policy, tokenizer, held_out, settings["max_completion_length"])
        finally:
            policy.train(was_training)

    tracker = accuracy_tracker(evaluate, eval_every, lambda: generation_stopped(trainer))
    with tempfile.TemporaryDirectory() as output_dir:
        extra = {}
        if library != "trl":
            extra = {
                "write_report": False,
                "dynamic_sampling": levers["dynamic_sampling"],
                "max_num_gen_batches": levers["max_num_gen_batches"],
            }
        if library == "posttrain-async":
            extra.update(async_generation_rounds=1, async_generation_process=True)
        args = GRPOConfig(output_dir=output_dir, **settings, **extra)
        trainer = GRPOTrainer(
            model,
            example.numeric_accuracy,
            args=args,
            processing_class=tokenizer,
            train_dataset=example.arithmetic_problems(train_size, 0),
            callbacks=[tracker],
        )
        if library != "trl":
            trainer.generation_backend.share_prefill = not levers["no_shared_prefill"]
            trainer.generation_backend.drop_finished = not levers["no_drop_finished"]
            if levers["no_shared_prompt_forward"]:
                from posttrain.online import logps as online_logps

                online_logps.shared_prompt_logps = lambda *args: None
        torch.manual_seed(settings["seed"])
        trainer.train()
    logs = trainer.state.log_history
    zero_std = [h["frac_reward_zero_std"] for h in logs if "frac_reward_zero_std" in h]
    return {
        "points": tracker.points,
        "frac_reward_zero_std": sum(zero_std) / max(len(zero_std), 1),
        "train_reward": [round(h["reward"], 3) for h in logs if "reward" in h],
    }


@contextlib.contextmanager
def generation_stopped(trainer):
    """The trainer's generation process, if it has one, stopped (SIGSTOP) for the duration."""
    process = getattr(getattr(trainer, "rollout_producer", None), "process", None)
    if process is None or not process.is_alive():
        yield
        return
    os.kill(process.pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(process.pid, signal.SIGCONT)


def first_gain(points: list[dict], gain: float) -> str:
    """The first evaluation at least `gain` above the first one, as "step S, M min" of wall training time."""
    for point in points:
        if point["accuracy"] >= points[0]["accuracy"] + gain - 1e-9:
            return f"step {point['step']}, {point['train_wall_s'] / 60:.1f} min"
    return "not reached"


def mean_curve(runs: list[list[dict]]) -> list[dict]:
    """The runs' points averaged step by step (accuracy and training clocks), over the steps every run evaluated:
    the expected curve of a configuration, which the single runs' sampling luck scatters around."""
    steps = sorted(set.intersection(*({p["step"] for p in run} for run in runs)))
    at = [{p["step"]: p for p in run} for run in runs]
    return [
        {
            "step": step,
            **{key: sum(run[step][key] for run in at) / len(at) for key in ("train_wall_s", "train_cpu_s", "accuracy")},
        }
        for step in steps
    ]


def summary_rows(label: str, runs: list[tuple[str, dict]]) -> list[list]:
    """One table row per run, then with several runs of a library one for the mean of its runs."""

    def row(name, points, zero_std):
        return [
            label,
            name,
            points[-1]["step"],
            points[0]["accuracy"],
            points[-1]["accuracy"],
            max(p["accuracy"] for p in points),
            points[-1]["train_wall_s"] / 60,
            points[-1]["train_cpu_s"] / 60,
            zero_std,
            first_gain(points, 0.10),
        ]

    rows = [row(library, result["points"], result["frac_reward_zero_std"]) for library, result in runs]
    for library in dict.fromkeys(library for library, _ in runs):
        mine = [result for name, result in runs if name == library]
        if len(mine) > 1:
            rows.append(
                row(
                    f"{library}: mean of {len(mine)}",
                    mean_curve([r["points"] for r in mine]),
                    sum(r["frac_reward_zero_std"] for r in mine) / len(mine),
                )
            )
    return rows


def write_outputs(output_dir: Path, rows: list[dict], summary: list[list]) -> None:
    """Appends the points to points.csv, writes this command's table.md, redraws accuracy.png from points.csv."""
    output_dir.mkdir(parents=True, exist_ok=True)
    points = output_dir / "points.csv"
    new = not points.exists()
    with points.open("a", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=FIELDS)
        if new:
            writer.writeheader()
        writer.writerows(rows)
    headers = [
        "label",
        "library",
        "steps",
        "accuracy start",
        "accuracy end",
        "best",
        "train min wall",
        "train min CPU",
        "frac zero-std groups",
        "first +10 points",
    ]
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(f"{v:.3f}" if isinstance(v, float) else str(v) for v in row) + " |" for row in summary]
    (output_dir / "table.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))

    plot_curves(points, output_dir / "accuracy.png")


MEAN_COLORS = {"trl": "black", "posttrain": "tab:blue", "posttrain-async": "tab:red"}  # each side's mean curve


def plot_curves(points: Path, image: Path) -> None:
    """Accuracy against training minutes (wall and CPU clock) for every run in `points`, and dashed, each library's
    mean curve over the repeats of a label."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    with points.open() as handle:
        everything = list(csv.DictReader(handle))
    runs = {}
    for r in everything:
        runs.setdefault((r["label"], r["library"], r["repeat"]), []).append(
            {"step": int(r["step"]), **{k: float(r[k]) for k in ("train_wall_s", "train_cpu_s", "accuracy")}}
        )
    figure, axes = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
    curves = [
        (f"{library} {label} #{repeat}", run, {"marker": "o", "alpha": 0.6})
        for (label, library, repeat), run in sorted(runs.items())
    ]
    for label, library in sorted({(label, library) for label, library, _ in runs}):
        mine = [run for (name, lib, _), run in runs.items() if (name, lib) == (label, library)]
        if len(mine) > 1:
            curves.append(
                (
                    f"{library} {label}: mean of {len(mine)}",
                    mean_curve(mine),
                    {"linestyle": "--", "linewidth": 2.5, "color": MEAN_COLORS.get(library, "tab:gray")},
                )
            )
    for name, run, style in curves:
        for axis, clock in zip(axes, ("train_wall_s", "train_cpu_s")):
            axis.plot([p[clock] / 60 for p in run], [p["accuracy"] for p in run], label=name, **style)
    for axis, name in zip(axes, ("wall", "CPU")):
        axis.set_xlabel(f"training minutes ({name} clock, evaluation excluded)")
        axis.grid(alpha=0.3)
    axes[0].set_ylabel("held-out greedy accuracy")
    axes[1].legend(fontsize=7)
    figure.suptitle("GRPO, SmolLM2-135M-Instruct, 2-term arithmetic")
    figure.tight_layout()
    figure.savefig(image, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--sides", nargs="+", default=["trl", "posttrain"], choices=["trl", "posttrain", "posttrain-async"]
    )
    parser.add_argument("--threads", type=int, default=1, help="compute threads of every run (the async side splits)")
    parser.add_argument("--repeats", type=int, default=1, help="runs per side, repeat r with seed --seed + r")
    parser.add_argument("--label", default="default", help="names this configuration's rows (ablations)")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--eval_every", type=int, default=10)
    parser.add_argument("--eval_size", type=int, default=200)
    parser.add_argument("--train_size", type=int, default=2000)
    parser.add_argument("--per_device_train_batch_size", type=int, default=16)
    parser.add_argument("--num_generations", type=int, default=8)
    parser.add_argument("--max_completion_length", type=int, default=16)
    parser.add_argument("--learning_rate", type=float, default=1e-5)
    parser.add_argument("--lr_scheduler_type", default="linear", help="TRL's default decays linearly to 0 at --steps")
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--beta", type=float, default=0.0)
    parser.add_argument("--loss_type", default="dapo")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dynamic_sampling", action="store_true")
    parser.add_argument("--max_num_gen_batches", type=int, default=3)
    parser.add_argument("--no_shared_prefill", action="store_true")
    parser.add_argument("--no_drop_finished", action="store_true")
    parser.add_argument("--no_shared_prompt_forward", action="store_true")
    parser.add_argument(
        "--parallel",
        action="store_true",
        help="run every side at once, one single-threaded process each (one core each on 2 cores)",
    )
    parser.add_argument("--output_dir", default="outputs/time_to_accuracy")
    parser.add_argument(
        "--allocator",
        choices=["tcmalloc", "system"],
        default="tcmalloc",
        help="both sides with tcmalloc preloaded (as the `posttrain` command runs) or glibc malloc",
    )
    options = parser.parse_args()
    # The allocator changes a CPU step's time a lot here, for both libraries: set per command, never inherited.
    child_env = {"LD_PRELOAD": (tcmalloc_path() or "") if options.allocator == "tcmalloc" else ""}
    child_env.update(OMP_NUM_THREADS=str(options.threads), MKL_NUM_THREADS=str(options.threads))
    print(f"allocator: {child_env['LD_PRELOAD'] or 'glibc malloc'}; {options.threads} thread(s) per run", flush=True)

    settings = dict(
        max_steps=options.steps,
        learning_rate=options.learning_rate,
        lr_scheduler_type=options.lr_scheduler_type,
        per_device_train_batch_size=options.per_device_train_batch_size,
        num_generations=options.num_generations,
        max_completion_length=options.max_completion_length,
        temperature=options.temperature,
        beta=options.beta,
        loss_type=options.loss_type,
        seed=options.seed,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        use_cpu=True,
        bf16=False,
        disable_tqdm=True,
    )
    levers = {
        k: getattr(options, k)
        for k in (
            "dynamic_sampling",
            "max_num_gen_batches",
            "no_shared_prefill",
            "no_drop_finished",
            "no_shared_prompt_forward",
        )
    }
    runs = [
        (repeat, library)
        for repeat in range(options.repeats)
        for library in (options.sides if repeat % 2 == 0 else list(reversed(options.sides)))
    ]

    def run(repeat_library):
        repeat, library = repeat_library
        started = time.perf_counter()
        result = run_isolated(
            "bench_time_to_accuracy:run_side",
            dict(
                library=library,
                settings={**settings, "seed": options.seed + repeat},
                eval_size=options.eval_size,
                eval_every=options.eval_every,
                train_size=options.train_size,
                levers=levers,
            ),
            env=child_env,
        )
        print(
            f"{library} #{repeat}: "
            + ", ".join(f"step {p['step']} {p['accuracy']:.3f}" for p in result["points"])
            + f" ({time.perf_counter() - started:.0f} s with evaluations; load {os.getloadavg()[0]:.1f})",
            flush=True,
        )
        return result

    if options.parallel:  # each side on its own core: same neighbours for both, half the waiting
        with ThreadPoolExecutor(len(options.sides)) as pool:
            results = list(pool.map(run, runs))
    else:
        results = [run(r) for r in runs]
    rows = [
        {"label": options.label, "library": library, "repeat": repeat, **p}
        for (repeat, library), result in zip(runs, results)
        for p in result["points"]
    ]
    summary = summary_rows(options.label, [(library, result) for (_, library), result in zip(runs, results)])
    write_outputs(Path(options.output_dir), rows, summary)


if __name__ == "__main__":
    main()
