"""Transformers-backend generation on SmolLM2-135M-Instruct: posttrain's backend against TRL 1.16's path.

The workload is a GRPO generation round: `--prompts` distinct reasoning-gym arithmetic prompts (chat template
applied), `--num_generations` completions each, sampled at temperature 1 up to `--max_completion_length`
tokens. TRL's side is its GRPOTrainer's own `_generate_single_turn` (the transformers `generate` call on the
prompts repeated num_generations times, left-padded), on a GRPOTrainer built with the same settings. posttrain's
rows are its backend with each saving switched off in turn, and its `generate` fallback:

    posttrain            one prefill per prompt, finished rows leave the batch
    posttrain-noshare    every completion prefills its own copy of the prompt
    posttrain-nodrop     finished rows stay in the batch until the last one ends
    posttrain-generate   transformers' `generate` with posttrain's sampler (what TRL does, plus the sampler)
    posttrain-static     the same with cache_implementation="static"

Each library/variant runs in a fresh single-threaded interpreter (benchmarks/common.py), the variants alternate
order between repeats, and every run generates the same rounds (same prompts, same seeds for posttrain). Tokens
are the completions' tokens up to and including the stop token. tok/s is given per second of wall time and per
second of the process's CPU time: on a machine shared with other jobs the CPU-time figure is the one that
measures the code (wall time then mostly measures the neighbours).

    OMP_NUM_THREADS=1 python benchmarks/bench_generation.py [--repeats 2] [--rounds 2] [--prompts 4]
        [--num_generations 8] [--max_completion_length 32] [--variants trl posttrain ...]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time

from common import REPO_ROOT, print_table, run_isolated

VARIANTS = ("trl", "posttrain", "posttrain-noshare", "posttrain-nodrop", "posttrain-generate", "posttrain-static")


def prompt_rounds(rounds: int, prompts: int, tokenizer) -> list[list[list[int]]]:
    """`rounds` lists of `prompts` distinct chat-formatted arithmetic prompts, as token ids."""
    sys.path.insert(0, str(REPO_ROOT / "examples"))
    from grpo_arithmetic import arithmetic_problems

    problems = arithmetic_problems(rounds * prompts, seed=77)["prompt"]
    ids = [
        tokenizer.apply_chat_template(p, add_generation_prompt=True, tokenize=True, return_dict=False) for p in problems
    ]
    return [ids[r * prompts : (r + 1) * prompts] for r in range(rounds)]


def _trl_generate(model, tokenizer, num_generations: int, max_completion_length: int):
    """TRL's GRPOTrainer generation: returns a function of (prompt ids, seed) -> completion ids."""
    import torch
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    output_dir = tempfile.mkdtemp(prefix="bench_generation_")
    args = GRPOConfig(
        output_dir=output_dir,
        per_device_train_batch_size=num_generations,
        num_generations=num_generations,
        max_completion_length=max_completion_length,
        temperature=1.0,
        use_cpu=True,
        bf16=False,  # posttrain's side generates with the float32 model as loaded: the same precision here
        report_to="none",
        save_strategy="no",
        disable_tqdm=True,
    )
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=lambda completions, **kw: [0.0] * len(completions),
        args=args,
        train_dataset=Dataset.from_list([{"prompt": "x"}] * num_generations),
        processing_class=tokenizer,
    )

    def generate(prompt_ids, seed):
        torch.manual_seed(seed)
        repeated = [list(p) for p in prompt_ids for _ in range(num_generations)]  # what its sampler hands over
        completion_ids, _ = trainer._generate_single_turn(repeated, None, {}, num_generations)
        return completion_ids

    return generate


def _posttrain_generate(variant: str, model, tokenizer, num_generations: int, max_completion_length: int):
    import torch

    from posttrain.generation import SamplingParams, TransformersBackend, stop_token_ids

    options = {
        "posttrain-noshare": {"share_prefill": False},
        "posttrain-nodrop": {"drop_finished": False},
        "posttrain-static": {"cache_implementation": "static"},
    }.get(variant, {})
    backend = TransformersBackend(model, tokenizer.pad_token_id, stop_token_ids(tokenizer, model), **options)
    sampling = SamplingParams(max_tokens=max_completion_length, temperature=1.0)

    def generate(prompt_ids, seed):
        if variant == "posttrain-generate":  # the fallback path, as `generate` would be entered for it
            from posttrain.generation.base import completion_seeds

            with torch.no_grad():
                completions = backend.generate_with_transformers(
                    model.eval(),
                    prompt_ids,
                    num_generations,
                    sampling,
                    completion_seeds(seed, len(prompt_ids), num_generations),
                )
        else:
            completions = backend.generate(prompt_ids, num_generations, sampling, seed=seed)
        return [c.token_ids for c in completions]

    return generate


def run_variant(variant: str, rounds: int, prompts: int, num_generations: int, max_completion_length: int) -> dict:
    """Warms up on one small call, then times `rounds` generation rounds; returns totals."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from posttrain.models.builtin import builtin_model_path

    path = builtin_model_path()
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path)
    factory = _trl_generate if variant == "trl" else _posttrain_generate
    generate = factory(
        *(() if variant == "trl" else (variant,)), model, tokenizer, num_generations, max_completion_length
    )
    work = prompt_rounds(rounds, prompts, tokenizer)
    generate(work[0][:1], seed=12345)  # warm-up: allocator, kernels, lazy imports
    tokens, wall, cpu, finished = 0, 0.0, 0.0, 0
    for r, prompt_ids in enumerate(work):
        start_wall, start_cpu = time.perf_counter(), time.process_time()
        completions = generate(prompt_ids, seed=r)
        wall += time.perf_counter() - start_wall
        cpu += time.process_time() - start_cpu
        tokens += sum(len(c) for c in completions)
        finished += sum(len(c) < max_completion_length for c in completions)
    return {"tokens": tokens, "wall_s": wall, "cpu_s": cpu, "finished": finished / (rounds * prompts * num_generations)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--num_generations", type=int, default=8)
    parser.add_argument("--max_completion_length", type=int, default=32)
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS[:5]), choices=VARIANTS)
    options = parser.parse_args()

    results: dict[str, list[dict]] = {v: [] for v in options.variants}
    for repeat in range(options.repeats):
        for variant in options.variants if repeat % 2 == 0 else reversed(options.variants):
            result = run_isolated(
                "bench_generation:run_variant",
                dict(
                    variant=variant,
                    rounds=options.rounds,
                    prompts=options.prompts,
                    num_generations=options.num_generations,
                    max_completion_length=options.max_completion_length,
                ),
            )
            results[variant].append(result)
            print(
                f"repeat {repeat + 1} {variant}: {result['tokens']} tokens, {result['tokens'] / result['wall_s']:.1f} "
                f"tok/s wall, {result['tokens'] / result['cpu_s']:.1f} tok/s CPU",
                flush=True,
            )

    def median(variant, key):
        return statistics.median(r["tokens"] / r[key] for r in results[variant])

    reference = "trl" if "trl" in results else options.variants[0]
    rows = [
        [
            v,
            statistics.median(r["tokens"] for r in results[v]),
            median(v, "wall_s"),
            median(v, "cpu_s"),
            median(v, "cpu_s") / median(reference, "cpu_s"),
            statistics.median(r["finished"] for r in results[v]),
            statistics.median(r["peak_rss_mb"] for r in results[v]),
        ]
        for v in options.variants
    ]
    print_table(
        ["variant", "tokens", "tok/s wall", "tok/s CPU", f"CPU tok/s / {reference}", "stopped early", "peak RSS MB"],
        rows,
        title=f"\nmedians of {options.repeats} runs x {options.rounds} rounds of {options.prompts} prompts x "
        f"{options.num_generations} completions <= {options.max_completion_length} tokens, SmolLM2-135M, "
        "OMP_NUM_THREADS=1",
    )


if __name__ == "__main__":
    main()
