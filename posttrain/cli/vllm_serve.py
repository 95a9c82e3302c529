"""`posttrain vllm-serve MODEL`: starts vLLM's OpenAI-compatible server for server-mode training.

It runs `python -m vllm.entrypoints.openai.api_server` (vLLM's `vllm serve` script fails in some builds)
with what training needs: the development routes (`VLLM_SERVER_DEV_MODE=1`: pause, resume, weight
reload, prefix-cache reset), posttrain's worker extension (correct weight reloads on CPU), log-probs of
the sampling distribution actually used (`processed_logprobs`), no sampling defaults taken from the
model's generation_config (the trainer sends every sampling setting), eager mode unless `--compile`, and
a capped KV cache. Arguments after `--` go to vLLM unchanged.

If the server dies mid-run, start it again with the same command (same host and port): the trainers wait for
it (up to their vllm_server_timeout), push their current weights to it again and carry on.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
from pathlib import Path

from posttrain.cli.args import CommandParser
from posttrain.errors import ConfigError

DESCRIPTION = "start a vLLM server that the online trainers use with use_vllm=True, vllm_mode='server'"


def build_parser() -> argparse.ArgumentParser:
    parser = CommandParser(prog="posttrain vllm-serve", description=DESCRIPTION)
    parser.add_argument(
        "model",
        help="Model to serve: a path, a hub id in the local cache, or "
        "builtin:SmolLM2-135M-Instruct. Serve the model you train.",
    )
    parser.add_argument(
        "--host",
        default="127.0.0.1",
        help="Address to listen on (default 127.0.0.1: this machine only; 0.0.0.0 for trainers on other machines).",
    )
    parser.add_argument("--port", type=int, default=8000, help="Port (default 8000).")
    parser.add_argument(
        "--max-model-len", type=int, default=1024, help="Longest prompt + completion in tokens (default 1024)."
    )
    parser.add_argument(
        "--dtype",
        default="auto",
        help="Weights' dtype: auto (the checkpoint's), float32, bfloat16. "
        "float32 matches a float32 trainer's log-probs to ~1e-4.",
    )
    parser.add_argument(
        "--kv-cache-gb",
        type=float,
        default=2.0,
        help="KV cache size in GiB (default 2; on CPU vLLM would otherwise take ~20 GiB). "
        "Pass 0 to let vLLM size it from --gpu-memory-utilization on a GPU.",
    )
    parser.add_argument(
        "--gpu-memory-utilization",
        type=float,
        default=None,
        help="Fraction of GPU memory vLLM may use (with --kv-cache-gb 0).",
    )
    parser.add_argument(
        "--compile",
        action="store_true",
        help="Let vLLM compile the model (CUDA graphs / torch.compile): slower start-up, faster "
        "generation for large models on GPUs. Default: eager mode.",
    )
    parser.add_argument(
        "--weight-transfer",
        choices=("nccl",),
        default=None,
        help="Enable vLLM's NCCL weight-transfer engine for GPU trainers (the fast sync path).",
    )
    parser.add_argument(
        "--cache-dir", default=None, help="vLLM's cache directory (VLLM_CACHE_ROOT; default ~/.cache/posttrain/vllm)."
    )
    return parser


def make_parser(subparsers=None, prog: str | None = None) -> argparse.ArgumentParser:
    """TRL's `make_parser`: vllm-serve's parser; with `subparsers` (argparse's `add_subparsers()`), added to them as
    the `vllm-serve` command."""
    parser = build_parser()
    if prog is not None:
        parser.prog = prog
    if subparsers is None:
        return parser
    return subparsers.add_parser(
        "vllm-serve", parents=[parser], conflict_handler="resolve", help=DESCRIPTION, description=DESCRIPTION
    )


def build_server_command(argv: list[str]) -> tuple[list[str], dict[str, str]]:
    """The command line and environment that start the server described by `argv` (vllm-serve's arguments,
    then optionally `--` and arguments for vLLM itself)."""
    from posttrain.generation.vllm_client import WORKER_EXTENSION  # imports torch: only when a server starts
    from posttrain.models.loading import resolve_model_path

    ours, passthrough = (argv[: argv.index("--")], argv[argv.index("--") + 1 :]) if "--" in argv else (argv, [])
    args = build_parser().parse_args(ours)
    if args.kv_cache_gb < 0:
        raise ConfigError(f"--kv-cache-gb={args.kv_cache_gb} must be >= 0 (0: let vLLM size the KV cache).")
    command = [
        sys.executable,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        resolve_model_path(args.model),
        "--served-model-name",
        args.model,
        "--host",
        args.host,
        "--port",
        str(args.port),
        "--max-model-len",
        str(args.max_model_len),
        "--dtype",
        args.dtype,
        "--worker-extension-cls",
        WORKER_EXTENSION,
        "--logprobs-mode",
        "processed_logprobs",
        "--generation-config",
        "vllm",
    ]
    if args.kv_cache_gb > 0:
        command += ["--kv-cache-memory-bytes", str(int(args.kv_cache_gb * 2**30))]
    if args.gpu_memory_utilization is not None:
        command += ["--gpu-memory-utilization", str(args.gpu_memory_utilization)]
    if not args.compile:
        command.append("--enforce-eager")
    if args.weight_transfer:
        command += ["--weight-transfer-config", f'{{"backend": "{args.weight_transfer}"}}']
    cache_dir = args.cache_dir or str(Path("~/.cache/posttrain/vllm").expanduser())
    env = {**os.environ, "VLLM_SERVER_DEV_MODE": "1", "VLLM_CACHE_ROOT": cache_dir}
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)  # set for colocate mode; the server runs its engine apart
    return command + passthrough, env


def main(argv: list[str] | None = None) -> int:
    """Replaces this process with the vLLM server (so that signals reach it); returns only on an error."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in ("-h", "--help"):
        build_parser().print_help()
        return 0
    if importlib.util.find_spec("vllm") is None:
        raise ConfigError(
            f"vLLM is not installed in this Python ({sys.executable}). Create its environment with "
            "`bash scripts/setup_vllm.sh` and run `.venv-vllm/bin/posttrain vllm-serve ...`."
        )
    command, env = build_server_command(argv)
    print("posttrain vllm-serve:", " ".join(command), file=sys.stderr, flush=True)
    os.execve(command[0], command, env)
    return 1  # not reached


if __name__ == "__main__":
    sys.exit(main())
