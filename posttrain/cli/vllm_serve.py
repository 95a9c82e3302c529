"""`posttrain vllm-serve MODEL`: starts vLLM's OpenAI-compatible server for server-mode training.

The flags are TRL 1.16's `trl vllm-serve` flags (`ScriptArguments`, each in TRL's two spellings, `--max_model_len`
and `--max-model-len`) with TRL's meaning, plus posttrain's `--kv-cache-gb`, `--weight-transfer`, `--cache-dir` and
`--compile`; other arguments (or all after `--`) go to vLLM unchanged. Like TRL's server it runs with the
development routes (`VLLM_SERVER_DEV_MODE=1`), log-probs of the sampling distribution actually used
(`processed_logprobs`), no cap on the number of log-probs per token (`--max-logprobs -1`: teacher top-k above 20)
and vLLM's scale-out routes (vLLM >= 0.30: TRL's client sends multimodal prompts through them); posttrain adds its
worker extension (correct weight reloads on CPU). It runs `python -m vllm.entrypoints.openai.api_server`
(vLLM's `vllm serve` script fails in some builds).

Defaults depend on the device, resolved in `resolve_device_defaults`: on a GPU they are TRL's (KV cache sized by
`--gpu-memory-utilization 0.9`, CUDA graphs); on vLLM-CPU, where GPU memory has no meaning and compiling costs
70-100 s per start, the KV cache is capped at 2 GiB, the model runs in eager mode and the NCCL weight
transfer is off.

With `--weight-transfer nccl` (the default on a GPU, as TRL's server; the server on other GPUs than the trainer) the
trainers send weights over NCCL through vLLM's weight-transfer engine instead of through files
(posttrain/generation/vllm_nccl_sync.py); `--weight-transfer none` keeps the file sync.

If the server dies mid-run, start it again with the same command (same host and port): the trainers wait for
it (up to their vllm_server_timeout), push the weights of their last sync to it again and carry on.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import os
import sys
from dataclasses import dataclass, field, fields
from pathlib import Path

from posttrain.cli.args import CommandParser
from posttrain.errors import ConfigError

DESCRIPTION = "start a vLLM server that the online trainers use with use_vllm=True, vllm_mode='server'"

# What a default of None becomes on each device: TRL's values on a GPU; on vLLM-CPU GPU memory means nothing (the
# KV cache would take ~20 GiB without a cap) and CPU compilation costs 70-100 s per start for no gain on small models.
DEVICE_DEFAULTS = {
    "cuda": {"gpu_memory_utilization": 0.9, "enforce_eager": False, "kv_cache_gb": 0.0, "weight_transfer": "nccl"},
    "cpu": {"gpu_memory_utilization": None, "enforce_eager": True, "kv_cache_gb": 2.0, "weight_transfer": "none"},
}
SCALE_OUT_MIN_VLLM = (0, 30)  # `--enable-scale-out` exists from vLLM 0.30 on (TRL passes it from there)


def vllm_version() -> tuple[int, int] | None:
    """(major, minor) of the installed vLLM (GPU build `vllm` or CPU build `vllm-cpu`); None if not installed."""
    for name in ("vllm", "vllm-cpu"):
        try:
            release = importlib.metadata.version(name).split("+")[0].split(".")
            return int(release[0]), int(release[1])
        except (importlib.metadata.PackageNotFoundError, ValueError, IndexError):
            continue
    return None


def serving_device() -> str:
    """'cuda' where this Python's vLLM can serve on a GPU, else 'cpu' (vLLM's CPU build, or no GPU visible)."""
    try:
        importlib.metadata.version("vllm-cpu")
        return "cpu"
    except importlib.metadata.PackageNotFoundError:
        pass
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def resolve_device_defaults(args: argparse.Namespace, device: str | None = None) -> argparse.Namespace:
    """The one place device-dependent defaults are filled in: every option left None gets `device`'s value."""
    device = device or serving_device()
    resolved = argparse.Namespace(**vars(args))
    for name, value in DEVICE_DEFAULTS[device].items():
        if getattr(resolved, name, None) is None:
            setattr(resolved, name, value)
    return resolved


def _bool(text: str) -> bool:
    """TRL's (HfArgumentParser's) spelling of booleans on the command line."""
    lowered = str(text).lower()
    if lowered in ("yes", "true", "t", "y", "1"):
        return True
    if lowered in ("no", "false", "f", "n", "0"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")


def _spellings(name: str) -> list[str]:
    """TRL's two spellings of a flag: `--max_model_len` and `--max-model-len`."""
    return list(dict.fromkeys([f"--{name}", f"--{name.replace('_', '-')}"]))


# TRL's flags: (field, type, nargs, help); defaults are TRL's except the device-dependent ones (None here).
TRL_FLAGS = (
    ("revision", str, None, "Model revision (vLLM's --revision)."),
    ("tensor_parallel_size", int, None, "vLLM's tensor-parallel workers (default 1)."),
    ("data_parallel_size", int, None, "vLLM's data-parallel workers (default 1)."),
    (
        "host",
        str,
        None,
        "Address to listen on (default 0.0.0.0, TRL's: trainers on other machines can connect; 127.0.0.1 for "
        "this machine only).",
    ),
    ("port", int, None, "Port (default 8000)."),
    (
        "gpu_memory_utilization",
        float,
        None,
        "Fraction of GPU memory vLLM may use; it sizes the KV cache (default on a GPU: 0.9, TRL's; on vLLM-CPU not "
        "passed: --kv-cache-gb sizes the cache).",
    ),
    ("dtype", str, None, "Weights' dtype: auto (the checkpoint's; default), float32, bfloat16."),
    ("max_model_len", int, None, "Longest prompt + completion in tokens (default: the model's own context)."),
    ("enable_prefix_caching", _bool, None, "vLLM's prefix caching: true or false (default: vLLM's choice)."),
    (
        "enforce_eager",
        _bool,
        "?",
        "Eager mode, no CUDA graphs / compilation (default on a GPU: false, TRL's; on vLLM-CPU: true, since "
        "compiling costs 70-100 s per start there).",
    ),
    ("kv_cache_dtype", str, None, "KV cache dtype (default auto: the model's)."),
    ("trust_remote_code", _bool, "?", "Run the model repository's own code (default false)."),
    ("log_level", str, None, "uvicorn's log level (default info)."),
    ("vllm_model_impl", str, None, "vLLM's model implementation: vllm (default) or transformers."),
    ("distributed_executor_backend", str, None, "vLLM's executor backend (ray for several nodes)."),
    ("speculative_config", str, None, "vLLM's speculative decoding, as JSON."),
)


@dataclass
class ScriptArguments:
    """TRL's `trl vllm-serve` options (`trl.scripts.vllm_serve.ScriptArguments`): the same fields and defaults, also
    `posttrain vllm-serve`'s flags; `build_command` turns them into posttrain's server command."""

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


TRL_DEFAULTS = {f.name: f.default for f in fields(ScriptArguments)}


def build_parser() -> argparse.ArgumentParser:
    parser = CommandParser(
        prog="posttrain vllm-serve",
        usage="posttrain vllm-serve MODEL [options] [vLLM options] [-- vLLM options]",
        description=DESCRIPTION,
        allow_abbrev=False,
    )
    parser.add_argument(
        "--model",
        default=None,
        help="Model to serve (TRL's flag; or MODEL first): a path, a hub id in the local cache, or "
        "builtin:SmolLM2-135M-Instruct. Serve the model you train.",
    )
    for name, kind, nargs, text in TRL_FLAGS:
        default = None if name in DEVICE_DEFAULTS["cuda"] else TRL_DEFAULTS[name]
        optional = {"nargs": "?", "const": True} if nargs else {}
        parser.add_argument(*_spellings(name), dest=name, type=kind, default=default, help=text, **optional)
    parser.add_argument(
        "--kv-cache-gb",
        type=float,
        default=None,
        help="posttrain: KV cache size in GiB (--kv-cache-memory-bytes). Default on a GPU: none, "
        "--gpu-memory-utilization sizes it (TRL's); on vLLM-CPU: 2 (vLLM would otherwise take ~20 GiB). "
        "0: no cap.",
    )
    parser.add_argument(
        "--compile",
        dest="enforce_eager",
        action="store_const",
        const=False,
        default=argparse.SUPPRESS,
        help="posttrain: the same as --enforce-eager false (CUDA graphs / torch.compile).",
    )
    parser.add_argument(
        "--weight-transfer",
        choices=("nccl", "none"),
        default=None,
        help="posttrain: nccl enables vLLM's NCCL weight-transfer engine: a trainer on a GPU then syncs weights over "
        "NCCL (its rank 0 joins at vllm_group_port; serve on other GPUs than the trainer's); a trainer on a CPU is "
        "refused by such a server. none: trainers sync through files. Default on a GPU: nccl (TRL's server always "
        "has it); on vLLM-CPU: none.",
    )
    parser.add_argument(
        "--cache-dir",
        default=None,
        help="posttrain: vLLM's cache directory (VLLM_CACHE_ROOT; default ~/.cache/posttrain/vllm).",
    )
    parser.epilog = "Other arguments, and all after `--`, go to vLLM unchanged (as in TRL)."
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


def parse_serve_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    """vllm-serve's options and the arguments for vLLM: those the parser does not know and all after `--`."""
    ours, after = (argv[: argv.index("--")], argv[argv.index("--") + 1 :]) if "--" in argv else (argv, [])
    if any(word == "--config" or word.startswith("--config=") for word in ours):
        raise ConfigError(
            "--config: TRL's YAML of vllm-serve options is not read by posttrain vllm-serve; give them as flags "
            "(vLLM's own --config goes after `--`)."
        )
    positional = ours[0] if ours and not ours[0].startswith("-") else None
    args, unknown = build_parser().parse_known_args(ours[1:] if positional else ours)
    if positional and args.model and positional != args.model:
        raise ConfigError(f"Two models given: {positional!r} and --model {args.model!r}; give one.")
    args.model = args.model or positional
    if not args.model:
        raise ConfigError("No model given: `posttrain vllm-serve MODEL [options]` (or TRL's `--model MODEL`).")
    return args, unknown + after


def build_server_command(argv: list[str], device: str | None = None) -> tuple[list[str], dict[str, str]]:
    """The command line and environment that start the server described by `argv` (vllm-serve's arguments,
    then optionally `--` and arguments for vLLM itself) on `device` (default: `serving_device()`)."""
    args, passthrough = parse_serve_args(argv)
    return server_command(args, passthrough, device)


def _options(args: argparse.Namespace) -> list[str]:
    """TRL's options as vLLM flags, as TRL's command passes them."""
    command = ["--host", args.host, "--port", str(args.port), "--dtype", args.dtype]
    command += ["--tensor-parallel-size", str(args.tensor_parallel_size)]
    command += ["--data-parallel-size", str(args.data_parallel_size)]
    command += ["--kv-cache-dtype", args.kv_cache_dtype, "--model-impl", args.vllm_model_impl]
    command += ["--uvicorn-log-level", args.log_level]
    for flag, value in (
        ("--gpu-memory-utilization", args.gpu_memory_utilization),
        ("--revision", args.revision),
        ("--max-model-len", args.max_model_len),
        ("--distributed-executor-backend", args.distributed_executor_backend),
        ("--speculative-config", args.speculative_config),
    ):
        if value is not None:
            command += [flag, str(value)]
    if args.enable_prefix_caching is not None:
        command.append("--enable-prefix-caching" if args.enable_prefix_caching else "--no-enable-prefix-caching")
    if args.enforce_eager:
        command.append("--enforce-eager")
    if args.trust_remote_code:
        command.append("--trust-remote-code")
    return command


def server_command(
    args: argparse.Namespace, passthrough=(), device: str | None = None
) -> tuple[list[str], dict[str, str]]:
    """`build_server_command` from parsed options (the parser's names; None: `device`'s default)."""
    from posttrain.generation.vllm_client import WORKER_EXTENSION  # imports torch: only when a server starts
    from posttrain.models.loading import resolve_model_path

    args = resolve_device_defaults(args, device)
    if args.kv_cache_gb < 0:
        raise ConfigError(f"--kv-cache-gb={args.kv_cache_gb} must be >= 0 (0: no cap).")
    command = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", resolve_model_path(args.model)]
    command += ["--served-model-name", args.model, *_options(args), "--worker-extension-cls", WORKER_EXTENSION]
    # TRL's: log-probs after temperature/top-k (importance sampling), no cap of 20 on top-k log-probs (distillation)
    command += ["--logprobs-mode", "processed_logprobs", "--max-logprobs", "-1"]
    version = vllm_version()
    if version is not None and version >= SCALE_OUT_MIN_VLLM:
        command.append("--enable-scale-out")  # /v1/chat/completions/render, /inference/v1/generate: TRL's client
    if args.kv_cache_gb > 0:
        command += ["--kv-cache-memory-bytes", str(int(args.kv_cache_gb * 2**30))]
    if args.weight_transfer != "none":
        command += ["--weight-transfer-config", f'{{"backend": "{args.weight_transfer}"}}']
    cache_dir = args.cache_dir or str(Path("~/.cache/posttrain/vllm").expanduser())
    env = {**os.environ, "VLLM_SERVER_DEV_MODE": "1", "VLLM_CACHE_ROOT": cache_dir}
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)  # set for colocate mode; the server runs its engine apart
    return command + list(passthrough), env


def build_command(
    script_args: ScriptArguments, extra_args: list[str] | None = None, device: str | None = None
) -> list[str]:
    """TRL's `build_command`: the command line of posttrain's server for TRL's options (environment as `main` sets
    it). On a GPU every value is TRL's (NCCL weight transfer on); on vLLM-CPU the fields left at TRL's defaults
    that mean nothing there (gpu_memory_utilization, enforce_eager) take the CPU defaults and the NCCL engine is off
    (`resolve_device_defaults`). `extra_args` go to vLLM unchanged."""
    options = argparse.Namespace(**{f.name: getattr(script_args, f.name) for f in fields(ScriptArguments)})
    for name in DEVICE_DEFAULTS["cuda"]:
        if name in TRL_DEFAULTS and getattr(options, name) == TRL_DEFAULTS[name]:
            setattr(options, name, None)
    options.kv_cache_gb, options.weight_transfer, options.cache_dir = None, None, None
    return server_command(options, list(extra_args or []), device)[0]


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
