"""GRPO on the built-in SmolLM2-135M-Instruct with reasoning-gym arithmetic, generating with transformers'
`generate`, with vLLM colocated in the trainer, and with a vLLM server: steps/s, generated tokens/s and
held-out accuracy before and after the same number of steps.

Every mode runs in a fresh single-threaded interpreter (benchmarks/common.py), the server too
(OMP_NUM_THREADS=1), with the settings of examples/grpo_arithmetic.py. Run it in the vLLM environment:

    .venv-vllm/bin/python benchmarks/bench_vllm.py [--steps 20] [--modes transformers colocate server]

steps/s and tokens/s count training only: the server's start-up and the colocated engine's creation are
reported apart. Generated tokens/s is the completion tokens of all rounds over the time spent generating.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time

from common import REPO_ROOT, print_table, run_isolated

MODES = ("transformers", "colocate", "server")
MODEL = "builtin:SmolLM2-135M-Instruct"


def _example():
    """examples/grpo_arithmetic.py: the problems, the reward and the held-out evaluation."""
    sys.path.insert(0, str(REPO_ROOT / "examples"))
    import grpo_arithmetic

    return grpo_arithmetic


def held_out_accuracy(eval_size: int, max_completion_length: int) -> dict:
    """Greedy accuracy of the untrained model on the held-out problems."""
    from posttrain.models import load_causal_lm, load_tokenizer

    example = _example()
    tokenizer = load_tokenizer(MODEL)
    model = load_causal_lm(MODEL)
    problems = example.arithmetic_problems(eval_size, seed=1234)
    return {"accuracy": example.held_out_accuracy(model, tokenizer, problems, max_completion_length)}


def run_mode(mode: str, steps: int, eval_size: int, max_completion_length: int) -> dict:
    """Trains `steps` GRPO steps generating in `mode`; returns timings, generation statistics and accuracy."""
    import torch

    from posttrain import GRPOConfig, GRPOTrainer
    from posttrain.models import load_tokenizer

    example = _example()
    server, settings, server_start_s = None, {}, 0.0
    with tempfile.TemporaryDirectory() as output_dir:
        if mode == "server":
            server, url, server_start_s = _start_server(output_dir)
            settings = dict(use_vllm=True, vllm_mode="server", vllm_server_base_url=url)
        elif mode == "colocate":
            settings = dict(use_vllm=True, vllm_mode="colocate", vllm_kv_cache_gb=1.0)
        try:
            args = GRPOConfig(
                output_dir=output_dir,
                max_steps=steps,
                learning_rate=5e-6,
                per_device_train_batch_size=16,
                num_generations=8,
                max_completion_length=max_completion_length,
                max_prompt_length=128,
                temperature=1.0,
                logging_steps=1,
                save_strategy="no",
                report_to="none",
                seed=0,
                use_cpu=True,
                bf16=False,  # float32, as the published figures (bf16=None is autocast on a CPU too)
                disable_tqdm=True,
                **settings,
            )
            tokenizer = load_tokenizer(MODEL)
            started = time.perf_counter()
            trainer = GRPOTrainer(
                MODEL,
                example.numeric_accuracy,
                args=args,
                train_dataset=example.arithmetic_problems(2000, 0),
                processing_class=tokenizer,
            )
            setup_s = time.perf_counter() - started
            sync_s = _time_calls(trainer.generation_backend, "sync_weights")
            started = time.perf_counter()
            trainer.train()
            train_s = time.perf_counter() - started
        finally:
            if server is not None:
                server.terminate()
                server.wait(60)
        problems = example.arithmetic_problems(eval_size, seed=1234)
        accuracy = example.held_out_accuracy(trainer.model, tokenizer, problems, max_completion_length)
    logs = [entry for entry in trainer.state.log_history if "completions/mean_length" in entry]
    tokens = sum(entry["completions/mean_length"] * args.generation_batch_size for entry in logs)
    generation_s = sum(entry["time/generation"] for entry in logs)
    diffs = [entry["sampler/logp_diff_max"] for entry in trainer.state.log_history if "sampler/logp_diff_max" in entry]
    return {
        "mode": mode,
        "steps_per_s": steps / train_s,
        "train_s": train_s,
        "setup_s": setup_s + server_start_s,
        "generated_tokens_per_s": tokens / generation_s,
        "generation_share": generation_s / train_s,
        "sync_s_per_step": sum(sync_s) / steps,
        "reward_first5": sum(e["reward"] for e in logs[:5]) / len(logs[:5]),
        "reward_last5": sum(e["reward"] for e in logs[-5:]) / len(logs[-5:]),
        "accuracy_after": accuracy,
        "logp_diff_max": max(diffs) if diffs else None,
        "threads": torch.get_num_threads(),
    }


def _time_calls(obj, method: str) -> list[float]:
    """Wraps `obj.method` to append the wall time of every call to the returned list."""
    seconds: list[float] = []
    call = getattr(obj, method)

    def timed(*args, **kwargs):
        started = time.perf_counter()
        try:
            return call(*args, **kwargs)
        finally:
            seconds.append(time.perf_counter() - started)

    setattr(obj, method, timed)
    return seconds


def _start_server(workdir: str):
    """A `posttrain vllm-serve` server for the built-in model on a free port; (process, url, start-up s)."""
    import socket
    import subprocess

    from posttrain.cli.vllm_serve import build_server_command
    from posttrain.generation.vllm_client import VLLMClient

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    command, env = build_server_command(
        [
            MODEL,
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--max-model-len",
            "512",
            "--dtype",
            "float32",
            "--kv-cache-gb",
            "1",
        ]
    )
    started = time.perf_counter()
    process = subprocess.Popen(command, env=env, stdout=open(f"{workdir}/server.log", "w"), stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        VLLMClient(url).wait_until_ready(600)
    except Exception:
        process.terminate()
        raise
    return process, url, time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--eval_size", type=int, default=100)
    parser.add_argument("--max_completion_length", type=int, default=16)
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    options = parser.parse_args()
    common = dict(eval_size=options.eval_size, max_completion_length=options.max_completion_length)

    before = run_isolated("bench_vllm:held_out_accuracy", common)["accuracy"]
    print(f"held-out accuracy before training: {before:.3f} ({options.eval_size} problems, greedy)", flush=True)
    rows = []
    for mode in options.modes:
        result = run_isolated("bench_vllm:run_mode", dict(mode=mode, steps=options.steps, **common))
        print(f"{mode}: {result['steps_per_s']:.3f} steps/s", flush=True)
        rows.append(
            [
                mode,
                result["steps_per_s"],
                result["generated_tokens_per_s"],
                result["generation_share"],
                result["sync_s_per_step"],
                result["setup_s"],
                result["reward_first5"],
                result["reward_last5"],
                before,
                result["accuracy_after"],
                result["logp_diff_max"],
                result["peak_rss_mb"],
            ]
        )
    print_table(
        [
            "mode",
            "steps/s",
            "gen tok/s",
            "gen share",
            "sync s/step",
            "setup s",
            "reward 1-5",
            "reward last 5",
            "acc before",
            "acc after",
            "logp diff max",
            "peak RSS MB",
        ],
        rows,
        title=f"\nGRPO, {MODEL}, {options.steps} steps of 16 completions (8 per prompt) of <= "
        f"{options.max_completion_length} tokens, one thread per process",
    )


if __name__ == "__main__":
    main()
