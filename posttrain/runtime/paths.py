"""Which kernels a run uses, chosen from the device, the config and the packages installed: one pure function
(`choose_paths`), logged as the first line of training and shown by `posttrain env`.

posttrain's own fast paths (`runtime/measured.py`) run only on the devices they were measured on, unless the user
turns them on: `POSTTRAIN_FAST_PATHS=fused_layers,segment_attention` (or `all`) in the environment, or
`fused_layers=True` set explicitly in a config; `-name` in the list turns one off, `none` all of them. Everywhere
else a run gets the ecosystem's defaults, as TRL 1.16 on the same stack: the attention implementation the user or
the model sets (transformers' SDPA unless named; FlashAttention 2/3 when named and installed), padding-free rows
through FlashAttention's varlen kernel or SDPA with position ids, Liger kernels with `use_liger_kernel`, bf16
autocast on every device (a CPU included) unless fp16 is set, gradient checkpointing on an accelerator, and
`torch.compile` only when asked for."""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass, field

from posttrain.errors import ConfigError
from posttrain.runtime.measured import MEASURED

ENV_VAR = "POSTTRAIN_FAST_PATHS"
# package module -> the kernel name used below
KERNEL_MODULES = {"flash_attn": "flash_attn", "flash_attn_interface": "flash_attn_3", "liger_kernel": "liger_kernel"}
FLASH = {"flash_attention_2": "flash_attn", "flash_attention_3": "flash_attn_3"}


def installed_kernels() -> frozenset[str]:
    """The optional kernel packages importable here (found without importing them)."""
    return frozenset(name for module, name in KERNEL_MODULES.items() if importlib.util.find_spec(module) is not None)


def forced_paths(value: str | None = None) -> dict[str, bool]:
    """The user's overrides from `POSTTRAIN_FAST_PATHS` (or `value`): {path: on}. A comma-separated list of paths
    turns them on on every device, `-name` turns one off, `all` / `none` every one; unset: no override. An unknown
    name is an error naming the known ones."""
    value = os.environ.get(ENV_VAR, "") if value is None else value
    overrides: dict[str, bool] = {}
    for item in (part.strip() for part in value.split(",")):
        if item in ("all", "none"):
            overrides.update(dict.fromkeys(MEASURED, item == "all"))
        elif item.lstrip("-") in MEASURED:
            overrides[item.lstrip("-")] = not item.startswith("-")
        elif item:
            raise ConfigError(
                f"{ENV_VAR}={value!r} names {item!r}, which is not one of posttrain's fast paths; use a "
                f"comma-separated list of {', '.join(sorted(MEASURED))} (-name turns one off), or 'all' or 'none'."
            )
    return overrides


def fast_path_on(name: str, device: str, forced: dict[str, bool] | None = None) -> bool:
    """Whether fast path `name` runs on device type `device`: as the user's override says, else where measured."""
    forced = forced_paths() if forced is None else forced
    return forced.get(name, device in MEASURED[name])


@dataclass(frozen=True)
class Paths:
    """The kernels of one run; `describe()` is the log line."""

    device: str
    fast: dict[str, bool] = field(default_factory=dict)
    attention: str = "sdpa"
    padding_free: str = "sdpa with position ids"
    liger: bool = False
    bf16: bool = False
    gradient_checkpointing: bool = False
    torch_compile: bool = False

    def describe(self) -> str:
        own = ", ".join(f"{name} {'on' if on else 'off'}" for name, on in self.fast.items())
        settings = [
            f"attention {self.attention}",
            f"padding-free {self.padding_free}",
            f"liger {'on' if self.liger else 'off'}",
            f"bf16 {'on' if self.bf16 else 'off'}",
            f"gradient checkpointing {'on' if self.gradient_checkpointing else 'off'}",
            f"torch.compile {'on' if self.torch_compile else 'off'}",
        ]
        return f"Device {self.device}: posttrain paths: {own}; ecosystem: {'; '.join(settings)}"


def choose_paths(
    device: str,
    *,
    attn_implementation: str | None = None,
    fused_layers: bool | None = None,
    use_liger_kernel: bool = False,
    bf16: bool | None = None,
    gradient_checkpointing: bool | None = None,
    torch_compile: bool = False,
    kernels: frozenset[str] = frozenset(),
    forced: dict[str, bool] | None = None,
    check: bool = True,
) -> Paths:
    """The paths of a run on device type `device` ('cpu', 'cuda', 'mps', 'xpu') with these settings (None: the
    default for the device) and `kernels` installed (`installed_kernels()`); `forced` is `forced_paths()`.

    Raises ConfigError for a setting the device or the installed packages cannot honour (FlashAttention named
    without its package or off CUDA, use_liger_kernel without liger-kernel); `check=False` only describes."""
    accelerator = device in ("cuda", "xpu")  # where TRL's gradient checkpointing default applies (bf16's: anywhere)
    package = FLASH.get(attn_implementation or "")
    if check and package is not None and (device != "cuda" or package not in kernels):
        need = "a CUDA GPU" if device != "cuda" else f"the {package} package (pip install {package.replace('_', '-')})"
        raise ConfigError(
            f"attn_implementation={attn_implementation!r} needs {need}; set attn_implementation='sdpa' "
            "(the default) or install it."
        )
    if check and use_liger_kernel and "liger_kernel" not in kernels:
        raise ConfigError("use_liger_kernel=True needs liger-kernel: pip install liger-kernel, or leave it False.")
    fast = {name: fast_path_on(name, device, forced) for name in MEASURED}
    if fused_layers is not None:
        fast["fused_layers"] = fused_layers  # the config's explicit choice
    if use_liger_kernel:
        fast["fused_layers"] = False  # Liger replaces these layers itself
    if package is not None or torch_compile:
        fast["segment_attention"] = False  # the varlen kernel separates sequences; compile traces the model's own
    attention = attn_implementation or "sdpa"
    if package is not None:
        padding_free = "flash-attention varlen"
    elif fast["segment_attention"]:
        padding_free = "segment attention"
    else:
        padding_free = f"{attention} with position ids"
    return Paths(
        device=device,
        fast=fast,
        attention=attention + ("" if attn_implementation else " (default)"),
        padding_free=padding_free,
        liger=use_liger_kernel,
        bf16=True if bf16 is None else bf16,  # TRL's default without fp16, on every device
        gradient_checkpointing=accelerator if gradient_checkpointing is None else gradient_checkpointing,
        torch_compile=torch_compile,
    )
