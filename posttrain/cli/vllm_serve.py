"""`posttrain vllm-serve MODEL`: starts vLLM's OpenAI-compatible server for server-mode training.

It runs `python -m vllm.entrypoints.openai.api_server` (vLLM's `vllm serve` script fails in some builds)
with what training needs: the development routes (`VLLM_SERVER_DEV_MODE=1`: pause, resume, weight
reload, prefix-cache reset), posttrain's worker extension (correct weight reloads on CPU), log-probs of
the sampling distribution actually used (`processed_logprobs`), no sampling defaults taken from the
model's generation_config (the trainer sends every sampling setting), eager mode unless `--compile`, and
a capped KV cache. Arguments after `--` go to vLLM unchanged.

With `--weight-transfer nccl` (GPUs only; the server on other GPUs than the trainer) the trainers send weights over
NCCL through vLLM's weight-transfer engine instead of through files (posttrain/generation/vllm_nccl_sync.py).

If the server dies mid-run, start it again with the same command (same host and port): the trainers wait for
it (up to their vllm_server_timeout), push the weights of their last sync to it again and carry on.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
from dataclasses import dataclass, field
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
        help="Enable vLLM's NCCL weight-transfer engine: a trainer on a GPU then syncs weights over NCCL instead of "
        "through files (its rank 0 joins at vllm_group_port; serve on other GPUs than the trainer's). A trainer on "
        "a CPU is refused by such a server.",
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
    ours, passthrough = (argv[: argv.index("--")], argv[argv.index("--") + 1 :]) if "--" in argv else (argv, [])
    return server_command(build_parser().parse_args(ours), passthrough)


def server_command(args: argparse.Namespace, passthrough=()) -> tuple[list[str], dict[str, str]]:
    """`build_server_command` from parsed options (the parser's names); `max_model_len=None` leaves the length to
    vLLM (the model's context), as TRL's `ScriptArguments` does."""
    from posttrain.generation.vllm_client import WORKER_EXTENSION  # imports torch: only when a server starts
    from posttrain.models.loading import resolve_model_path

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
        "--dtype",
        args.dtype,
        "--worker-extension-cls",
        WORKER_EXTENSION,
        "--logprobs-mode",
        "processed_logprobs",
        "--generation-config",
        "vllm",
    ]
    if args.max_model_len is not None:
        command += ["--max-model-len", str(args.max_model_len)]
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


@dataclass
class ScriptArguments:
    """TRL's `trl vllm-serve` options (`trl.scripts.vllm_serve.ScriptArguments`): the same fields and defaults, for
    `build_command`. The ones posttrain's own flags cover map onto them; the rest go to vLLM as TRL passes them."""

    model: str = field(metadata={"help": "Model to serve: a path or a hub id in the local cache."})
    revision: str | None = field(default=None, metadata={"help": "Model revision (vLLM's --revision)."})
    tensor_parallel_size: int = field(default=1, metadata={"help": "vLLM's tensor-parallel workers."})
    data_parallel_size: int = field(default=1, metadata={"help": "vLLM's data-parallel workers (1 for dense models)."})
    host: str = field(default="0.0.0.0", metadata={"help": "Address to listen on."})
    port: int = field(default=8000, metadata={"help": "Port."})
    gpu_memory_utilization: float = field(
        default=0.9, metadata={"help": "Fraction of GPU memory vLLM may use; it sizes the KV cache."}
    )
    dtype: str = field(default="auto", metadata={"help": "Weights' dtype (auto: the checkpoint's)."})
    max_model_len: int | None = field(
        default=None, metadata={"help": "Longest prompt + completion; None: the model's context."}
    )
    enable_prefix_caching: bool | None = field(default=None, metadata={"help": "vLLM's prefix caching on or off."})
    enforce_eager: bool | None = field(default=False, metadata={"help": "Eager mode (no CUDA graphs)."})
    kv_cache_dtype: str = field(default="auto", metadata={"help": "KV cache dtype (auto: the model's)."})
    trust_remote_code: bool = field(default=False, metadata={"help": "Run the model repository's own code."})
    log_level: str = field(default="info", metadata={"help": "uvicorn's log level."})
    vllm_model_impl: str = field(default="vllm", metadata={"help": "vLLM's model implementation (or transformers)."})
    distributed_executor_backend: str | None = field(
        default=None, metadata={"help": "vLLM's executor backend (ray for several nodes)."}
    )
    speculative_config: str | None = field(default=None, metadata={"help": "vLLM's speculative decoding, as JSON."})


def build_command(script_args: ScriptArguments, extra_args: list[str] | None = None) -> list[str]:
    """TRL's `build_command`: the command line of posttrain's server for TRL's options (environment as `main` sets
    it). The KV cache is sized by `gpu_memory_utilization` (no posttrain cap), CUDA graphs are on unless
    `enforce_eager`, and the NCCL weight transfer is on (trainers on a GPU sync over it), as in TRL; `extra_args`
    go to vLLM unchanged."""
    options = argparse.Namespace(
        model=script_args.model,
        host=script_args.host,
        port=script_args.port,
        max_model_len=script_args.max_model_len,
        dtype=script_args.dtype,
        kv_cache_gb=0.0,
        gpu_memory_utilization=script_args.gpu_memory_utilization,
        compile=not script_args.enforce_eager,
        weight_transfer="nccl",
        cache_dir=None,
    )
    vllm = ["--tensor-parallel-size", str(script_args.tensor_parallel_size)]
    vllm += ["--data-parallel-size", str(script_args.data_parallel_size)]
    vllm += ["--kv-cache-dtype", script_args.kv_cache_dtype, "--model-impl", script_args.vllm_model_impl]
    vllm += ["--uvicorn-log-level", script_args.log_level]
    if script_args.revision is not None:
        vllm += ["--revision", script_args.revision]
    if script_args.enable_prefix_caching is not None:
        vllm.append("--enable-prefix-caching" if script_args.enable_prefix_caching else "--no-enable-prefix-caching")
    if script_args.trust_remote_code:
        vllm.append("--trust-remote-code")
    for flag, value in (
        ("--distributed-executor-backend", script_args.distributed_executor_backend),
        ("--speculative-config", script_args.speculative_config),
    ):
        if value is not None:
            vllm += [flag, value]
    return server_command(options, vllm + list(extra_args or []))[0]


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
