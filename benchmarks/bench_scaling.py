"""Cost as the work grows: TRL 1.16 against posttrain along one axis at a time, one command per sweep.

    OMP_NUM_THREADS=1 python benchmarks/bench_scaling.py --sweep sft_seq [--points 512,1024,2048,4096] [--steps 3]
    OMP_NUM_THREADS=1 python benchmarks/bench_scaling.py --sweep model_size [--points smollm2,qwen2.5-0.5b]
    OMP_NUM_THREADS=1 python benchmarks/bench_scaling.py --sweep grpo_completion [--points 32,128] [--generations 8]
    OMP_NUM_THREADS=1 python benchmarks/bench_scaling.py --sweep sft_seq --points 8192 --rss_limit_gb 14 --tag 8k
    python benchmarks/bench_scaling.py --plot      # redraws docs/results/scaling/*.svg from the JSON files

Every run is a fresh single-threaded interpreter (benchmarks/common.py: its peak RSS is its own), and the runs
alternate posttrain, TRL, posttrain, TRL ... point by point, so that load on a shared machine hits both alike.
Each run trains `--steps` steps; the first is warm-up, the rest are timed in process CPU time (with one thread the
step time of an idle machine; wall time is recorded too). Settings both libraries get: SmolLM2-135M (the built-in
copy), LoRA r=16 on every linear layer, batch 1, one pre-tokenized sequence of the point's length (no padding),
lr 1e-4, `gradient_checkpointing=False` (TRL's default differs) and `bf16=False` (float32; both default to bf16
autocast), no report.

Results: docs/results/scaling/SWEEP.json (the commit, the date, the load average before and after, every run) and
SWEEP.svg (step time and the posttrain/TRL ratio against the swept quantity). MFU divides the model FLOPs (LoRA:
4 x parameters x tokens, full: 6 x; plus attention scores) by the matmul peak that benchmarks/machine_limits.py
measured (docs/results/scaling/machine.json), when there is one.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import argparse
import datetime
import json
import random
import subprocess
import tempfile
import time
from pathlib import Path

from common import REPO_ROOT, RSSExceeded, run_isolated

RESULTS = REPO_ROOT / "docs" / "results" / "scaling"
LIBRARIES = ("posttrain", "trl")
# Qwen2.5-0.5B's shape (random weights: cost only). SmolLM2-135M's own config is the built-in checkpoint's.
QWEN_05B = dict(
    hidden_size=896,
    intermediate_size=4864,
    num_hidden_layers=24,
    num_attention_heads=14,
    num_key_value_heads=2,
    vocab_size=151936,
    max_position_embeddings=32768,
    tie_word_embeddings=True,
    rope_theta=1000000.0,
)
# Qwen2.5-1.5B's shape and, for a second family (Llama), SmolLM2-1.7B's: random weights, cost only.
QWEN_15B = dict(QWEN_05B, hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12)
SMOLLM2_17B = dict(
    hidden_size=2048,
    intermediate_size=8192,
    num_hidden_layers=24,
    num_attention_heads=32,
    num_key_value_heads=32,
    vocab_size=49152,
    max_position_embeddings=8192,
    tie_word_embeddings=True,
    rope_theta=130000.0,
)
BUILT = {
    "qwen2.5-0.5b": ("qwen2", QWEN_05B),
    "qwen2.5-1.5b": ("qwen2", QWEN_15B),
    "smollm2-1.7b": ("llama", SMOLLM2_17B),
}


class Timer:
    """A transformers callback recording (wall, CPU) seconds at each optimizer step's end."""

    def __new__(cls):
        from transformers import TrainerCallback

        class StepTimer(TrainerCallback):
            def __init__(self):
                self.times: list = []
                self.begun: tuple = ()

            def on_step_begin(self, args, state, control, **kwargs):
                self.begun = (time.perf_counter(), time.process_time())

            def on_step_end(self, args, state, control, **kwargs):
                self.times.append((time.perf_counter(), time.process_time()))
                self.last = (self.begun, self.times[-1])

        return StepTimer()


def step_seconds(times: list, last: tuple | None = None) -> tuple[float, float]:
    """(wall, CPU) seconds per step from the first step's end to the last's; with one step (`--steps 1`, for the
    longest points), that step from its beginning to its end (`last`: warm-up included)."""
    if len(times) < 2:
        (wall_0, cpu_0), (wall_1, cpu_1) = last
        return wall_1 - wall_0, cpu_1 - cpu_0
    (wall_0, cpu_0), (wall_1, cpu_1) = times[0], times[-1]
    return (wall_1 - wall_0) / (len(times) - 1), (cpu_1 - cpu_0) / (len(times) - 1)


def model_path(name: str, root: str) -> str:
    """A local checkpoint for `name`: the built-in SmolLM2-135M, or a shape of BUILT with random weights and
    SmolLM2's tokenizer."""
    from posttrain.models.builtin import builtin_model_path

    smollm2 = builtin_model_path()
    if name == "smollm2":
        return smollm2
    path = Path(root) / name
    if not (path / "config.json").exists():
        import torch
        from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(smollm2)
        family, shape = BUILT[name]
        config = AutoConfig.for_model(
            family, **shape, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id
        )
        torch.manual_seed(0)
        AutoModelForCausalLM.from_config(config).save_pretrained(path)
        tokenizer.save_pretrained(path)
    return str(path)


def model_flops(config: dict, tokens: int, lora: bool) -> float:
    """Forward+backward FLOPs of one step: (4 with LoRA, else 6) x non-embedding-lookup parameters x tokens, plus
    the attention scores and values (2 matmuls of T x T x hidden per layer, forward; x2 backward)."""
    hidden, layers = config["hidden_size"], config["num_hidden_layers"]
    params = config["params"]
    attention = 2 * 2 * layers * tokens * tokens * hidden  # QK^T and AV, causal (half) x 2 FLOPs per MAC
    return (4 if lora else 6) * params * tokens + 3 * attention


def sft_run(library: str, path: str, tokens: int, steps: int, lora: bool = True) -> dict:
    """One SFT run: batch 1, one sequence of `tokens` random token ids (pre-tokenized, so no tokenizer cost)."""
    import torch
    from datasets import Dataset
    from transformers import AutoConfig

    if library == "posttrain":
        from posttrain import SFTConfig, SFTTrainer
    else:
        from trl import SFTConfig, SFTTrainer
    config = AutoConfig.from_pretrained(path)
    rng = random.Random(0)
    ids = [rng.randrange(300, min(config.vocab_size, 49152)) for _ in range(tokens)]
    extra = {"write_report": False} if library == "posttrain" else {}  # TRL writes no report
    args = SFTConfig(
        output_dir=tempfile.mkdtemp(prefix="bench_scaling_"),
        max_steps=steps,
        per_device_train_batch_size=1,
        max_length=tokens,
        learning_rate=1e-4,
        logging_steps=1,
        bf16=False,
        gradient_checkpointing=False,
        use_cpu=True,
        report_to="none",
        save_strategy="no",
        disable_tqdm=True,
        model_init_kwargs={"dtype": torch.float32},
        **extra,
    )
    peft_config = None
    if lora:
        from peft import LoraConfig

        peft_config = LoraConfig(r=16, lora_alpha=32, target_modules="all-linear", task_type="CAUSAL_LM")
    data = Dataset.from_list([{"input_ids": ids} for _ in range(steps)])
    trainer = SFTTrainer(path, args=args, train_dataset=data, peft_config=peft_config)
    timer = Timer()
    trainer.add_callback(timer)
    trainer.train()
    wall, cpu = step_seconds(timer.times, timer.last)
    model = trainer.model.get_base_model() if hasattr(trainer.model, "get_base_model") else trainer.model
    params = sum(p.numel() for name, p in model.named_parameters() if "lora_" not in name)
    shape = {"hidden_size": config.hidden_size, "num_hidden_layers": config.num_hidden_layers, "params": params}
    return {
        "step_s": cpu,
        "wall_step_s": wall,
        "tokens": tokens,
        "tokens_per_s": tokens / cpu,
        "flops_per_step": model_flops(shape, tokens, lora),
        "loss0": next(h["loss"] for h in trainer.state.log_history if "loss" in h),
        "lora": lora,
        "bf16": bool(trainer.args.bf16),
    }


def timed(owner, totals: dict, count) -> None:
    """Wraps `owner.generate` to add its wall and CPU seconds and its new tokens (`count(output, kwargs)`)."""
    generate = owner.generate

    def wrapper(*args, **kwargs):
        wall, cpu = time.perf_counter(), time.process_time()
        output = generate(*args, **kwargs)
        totals["generation_s"] += time.process_time() - cpu
        totals["generation_wall_s"] += time.perf_counter() - wall
        totals["tokens"] += count(output, args, kwargs)
        return output

    owner.generate = wrapper


def _new_tokens(pad_token_id: int):
    def count(output, args, kwargs):
        width = (kwargs["input_ids"] if "input_ids" in kwargs else args[0]).shape[1]
        return int((output[:, width:] != pad_token_id).sum())

    return count


def grpo_run(library: str, path: str, completion: int, generations: int, steps: int) -> dict:
    """One GRPO run: `generations` completions of up to `completion` tokens for one prompt per step, LoRA, beta 0.
    Generation is the time inside the generation call (TRL: `model.generate`; posttrain: its backend), in CPU time;
    the rest of the step (scoring, log-probs, update, bookkeeping) is `other_s_per_step`."""
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if library == "posttrain":
        from posttrain import GRPOConfig, GRPOTrainer
    else:
        from trl import GRPOConfig, GRPOTrainer
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path)
    content = "Count from {} to {}, one number a line."
    data = Dataset.from_list(
        [{"prompt": [{"role": "user", "content": content.format(i, i + 40)}]} for i in range(4 * steps)]
    )
    extra = {"write_report": False} if library == "posttrain" else {}
    args = GRPOConfig(
        output_dir=tempfile.mkdtemp(prefix="bench_scaling_"),
        max_steps=steps,
        per_device_train_batch_size=generations,
        num_generations=generations,
        max_completion_length=completion,
        learning_rate=1e-5,
        beta=0.0,
        logging_steps=1,
        seed=0,
        bf16=False,
        gradient_checkpointing=False,
        use_cpu=True,
        report_to="none",
        save_strategy="no",
        disable_tqdm=True,
        **extra,
    )
    lora = LoraConfig(r=16, lora_alpha=32, target_modules="all-linear", task_type="CAUSAL_LM")
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=lambda completion_ids, **kw: [float(len(c)) for c in completion_ids],
        args=args,
        train_dataset=data,
        processing_class=tokenizer,
        peft_config=lora,
    )
    totals = {"generation_s": 0.0, "generation_wall_s": 0.0, "tokens": 0}
    if library == "posttrain":
        timed(trainer.generation_backend, totals, lambda output, a, k: sum(len(c.token_ids) for c in output))
    else:
        timed(trainer.model, totals, _new_tokens(tokenizer.pad_token_id))
    timer = Timer()
    trainer.add_callback(timer)
    start = time.process_time()
    trainer.train()
    cpu_total = time.process_time() - start
    wall, cpu = step_seconds(timer.times, timer.last)
    return {
        "step_s": cpu,
        "wall_step_s": wall,
        "generation_s_per_step": totals["generation_s"] / steps,
        "generation_wall_s_per_step": totals["generation_wall_s"] / steps,
        "other_s_per_step": (cpu_total - totals["generation_s"]) / steps,
        "generated_tokens_per_step": totals["tokens"] / steps,
        "generation_tokens_per_s": totals["tokens"] / max(totals["generation_s"], 1e-9),
    }


def limit_mb(args) -> float | None:
    """`--rss_limit_gb` in MB (None: unwatched)."""
    return None if args.rss_limit_gb is None else args.rss_limit_gb * 1024


def run_point(sweep: str, point: str, library: str, root: str, args) -> dict:
    if sweep == "sft_seq":
        kwargs = dict(
            library=library, path=model_path("smollm2", root), tokens=int(point), steps=args.steps, lora=not args.full
        )
        return run_isolated("bench_scaling:sft_run", kwargs, timeout=args.timeout, rss_limit_mb=limit_mb(args))
    if sweep == "model_size":
        kwargs = dict(
            library=library, path=model_path(point, root), tokens=args.tokens, steps=args.steps, lora=not args.full
        )
        return run_isolated("bench_scaling:sft_run", kwargs, timeout=args.timeout, rss_limit_mb=limit_mb(args))
    kwargs = dict(
        library=library,
        path=model_path("smollm2", root),
        completion=int(point),
        generations=args.generations,
        steps=args.steps,
    )
    return run_isolated("bench_scaling:grpo_run", kwargs, timeout=args.timeout, rss_limit_mb=limit_mb(args))


DEFAULT_POINTS = {"sft_seq": "512,1024,2048,4096", "model_size": "smollm2,qwen2.5-0.5b", "grpo_completion": "32,128"}


def git_head() -> str:
    return subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, cwd=REPO_ROOT).stdout.strip()


def result_name(args) -> str:
    """SWEEP, or SWEEP_TAG with `--tag` (a further part of a curve, kept beside the first)."""
    return f"{args.sweep}_{args.tag}" if args.tag else args.sweep


def sweep(args) -> dict:
    root = tempfile.mkdtemp(prefix="bench_scaling_models_")
    record = {
        "sweep": args.sweep,
        "commit": git_head(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "loadavg_before": os.getloadavg(),
        "conditions": "1 thread per run, alternating posttrain/TRL; machine shared with other jobs (LOADED)",
        "settings": {key: getattr(args, key) for key in ("steps", "repeats", "tokens", "generations", "full")}
        | {"bf16": False, "rss_limit_gb": args.rss_limit_gb},
        "points": {},
        "failed": {},
        "exceeded": {},  # point -> library -> "exceeded N GB ...": killed by the --rss_limit_gb watchdog
    }
    for point in args.points.split(","):
        runs: dict[str, list] = {library: [] for library in LIBRARIES}
        for _ in range(args.repeats):
            for library in LIBRARIES:
                try:
                    result = run_point(args.sweep, point, library, root, args)
                except RSSExceeded as err:  # an outcome, not a failure: this library does not fit the ceiling
                    record["exceeded"].setdefault(point, {})[library] = str(err)
                    print(point, library, str(err), flush=True)
                    (RESULTS / f"{result_name(args)}.json").write_text(json.dumps(record, indent=1) + "\n")
                    continue
                except (RuntimeError, subprocess.TimeoutExpired) as err:
                    record["failed"].setdefault(point, {})[library] = str(err)[-600:]
                    continue
                result["loadavg"] = os.getloadavg()
                runs[library].append(result)
                print(point, library, json.dumps(result), flush=True)
                record["points"][point] = runs
                (RESULTS / f"{result_name(args)}.json").write_text(json.dumps(record, indent=1) + "\n")  # so far
    record["loadavg_after"] = os.getloadavg()
    return record


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sweep", choices=tuple(DEFAULT_POINTS))
    parser.add_argument("--points", help="comma-separated points of the sweep (default: see the usage)")
    parser.add_argument("--steps", type=int, default=3, help="steps per run; the first is warm-up")
    parser.add_argument("--repeats", type=int, default=1, help="alternating runs per library and point")
    parser.add_argument("--tokens", type=int, default=512, help="model_size: sequence length")
    parser.add_argument("--generations", type=int, default=8, help="grpo_completion: completions per prompt")
    parser.add_argument("--timeout", type=float, default=1800, help="seconds before one run is given up")
    parser.add_argument("--full", action="store_true", help="sft_seq, model_size: full fine-tuning, not LoRA")
    parser.add_argument("--tag", help="write SWEEP_TAG.json (a further part of a curve) instead of SWEEP.json")
    parser.add_argument(
        "--rss_limit_gb", type=float, help="kill a run whose resident memory passes this (recorded as 'exceeded')"
    )
    parser.add_argument("--plot", action="store_true", help="only redraw the plots from the JSON files")
    args = parser.parse_args()
    if not args.plot:
        if args.sweep is None:
            parser.error("--sweep is required unless --plot is given")
        args.points = args.points or DEFAULT_POINTS[args.sweep]
        RESULTS.mkdir(parents=True, exist_ok=True)
        record = sweep(args)
        (RESULTS / f"{result_name(args)}.json").write_text(json.dumps(record, indent=1) + "\n")
    from scaling_report import plot_all

    plot_all(RESULTS)


if __name__ == "__main__":
    main()
