"""The device a config trains on and the kernels chosen for it (`runtime/paths.py`), resolved when the config is
built (an impossible choice stops it there) and logged when the trainer prepares its model."""

from __future__ import annotations

import torch

from posttrain.models.fast_paths import describe_fast_paths
from posttrain.runtime.paths import Paths, choose_paths, forced_paths, installed_kernels


def run_device(args) -> str:
    """The device type `args` trains on, decided before transformers sets the device up."""
    if getattr(args, "use_cpu", False):
        return "cpu"
    if torch.cuda.is_available():
        return "cuda"
    if hasattr(torch, "xpu") and torch.xpu.is_available():
        return "xpu"
    if torch.backends.mps.is_available():
        return "mps"
    return "cpu"


def run_paths(
    args, attn_implementation: str | None = None, fused_layers: bool | None = None, check: bool = True
) -> Paths:
    """`choose_paths` for the config `args` (the attention implementation its model_init_kwargs name, unless given)."""
    if attn_implementation is None:
        attn_implementation = (args.model_init_kwargs or {}).get("attn_implementation")
    return choose_paths(
        run_device(args),
        attn_implementation=attn_implementation,
        fused_layers=fused_layers,
        use_liger_kernel=bool(args.use_liger_kernel),
        bf16=bool(args.bf16),
        gradient_checkpointing=bool(args.gradient_checkpointing),
        torch_compile=bool(args.torch_compile),
        kernels=installed_kernels(),
        forced=forced_paths(),
        check=check,
    )


def resolve_bf16(args) -> None:
    """bf16=None becomes TRL 1.16's default, `not fp16`, on every device: a CPU trains under bf16 autocast too.

    transformers refuses bf16 on a machine without an accelerator unless use_cpu is set (TRL's default config stops
    there with that error); the run is on the CPU either way, so use_cpu is set, and marked as set here (the model
    card leaves it out)."""
    if args.bf16 is None:
        args.bf16 = not args.fp16
    if args.bf16 and run_device(args) == "cpu":
        args.use_cpu, args._use_cpu_resolved = True, not args.use_cpu


def resolve_fused_layers(args) -> None:
    """Sets `args.fused_layers` (None: on where measured or turned on) and checks the run's kernel choices."""
    args.fused_layers = run_paths(args, fused_layers=args.fused_layers).fast["fused_layers"]


def describe_run(args, model) -> list[str]:
    """The first log lines of a run: the device and every path chosen, then the model's own fast paths."""
    attention = getattr(getattr(model, "config", None), "_attn_implementation", None)
    paths = run_paths(args, attn_implementation=attention, fused_layers=args.fused_layers, check=False)
    return [paths.describe(), describe_fast_paths(model)]
