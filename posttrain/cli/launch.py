"""Training in several processes: the command runs itself again through `accelerate launch` (`relaunch`); the
launched copies know it from LAUNCHED_ENV and train."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

from posttrain.cli.args import LaunchArguments
from posttrain.errors import ConfigError

LAUNCHED_ENV = "POSTTRAIN_LAUNCHED"
LAUNCH_FLAGS = ("--num_processes", "--accelerate_config")


def relaunch(name: str, argv: list[str], launch: LaunchArguments, settings: dict[str, Any]) -> int:
    """Runs this same command in `num_processes` processes through `accelerate launch`; returns its status.

    Without an accelerate config, `--multi_gpu` is what makes accelerate start N workers (its `--cpu` mode
    starts one); on a machine without CUDA the workers then train on the CPU over gloo (`--use_cpu true`).
    """
    import subprocess

    if launch.accelerate_config and not Path(launch.accelerate_config).is_file():
        preset = (
            ""
            if Path(launch.accelerate_config).suffix
            else (
                " posttrain ships no named accelerate presets (TRL's zero1/zero2/zero3/fsdp1/fsdp2/multi_gpu); write "
                "one with `accelerate config` and pass its path."
            )
        )
        raise ConfigError(f"--accelerate_config {launch.accelerate_config}: no such file.{preset}")
    child_args = _without_launch_flags(argv)
    command = [sys.executable, "-m", "accelerate.commands.launch"]
    if launch.accelerate_config:
        command += ["--config_file", launch.accelerate_config]
        if "num_processes" in settings:
            command += ["--num_processes", str(launch.num_processes)]
    else:
        command += [
            "--multi_gpu",
            "--num_processes",
            str(launch.num_processes),
            "--num_machines",
            "1",
            "--mixed_precision",
            "no",
            "--dynamo_backend",
            "no",
            "--main_process_port",
            "0",
        ]
        if "use_cpu" not in settings and not _has_cuda():
            child_args += ["--use_cpu", "true"]
    command += ["-m", "posttrain.cli.main", name, *child_args]
    return subprocess.run(command, env={**os.environ, LAUNCHED_ENV: "1"}, check=False).returncode


def _without_launch_flags(argv: list[str]) -> list[str]:
    kept, skip_value = [], False
    for token in argv:
        if skip_value:
            skip_value = False
        elif token in LAUNCH_FLAGS:
            skip_value = True
        elif not token.startswith(tuple(f"{flag}=" for flag in LAUNCH_FLAGS)):
            kept.append(token)
    return kept


def _has_cuda() -> bool:
    import torch

    return torch.cuda.is_available()
