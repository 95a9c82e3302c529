"""The `posttrain` subcommands as objects, at TRL's `trl.cli.commands` path."""

from posttrain.cli.commands.base import Command
from posttrain.cli.commands.env import EnvCommand
from posttrain.cli.commands.training import TrainingCommand
from posttrain.cli.commands.vllm_serve import VllmServeCommand


def get_commands() -> list[Command]:
    """Every top-level subcommand TRL's CLI has, in its order."""
    methods = ("distillation", "dpo", "grpo", "kto", "reward", "rloo", "sft")
    commands = [TrainingCommand(m) for m in methods] + [EnvCommand(), VllmServeCommand()]
    return sorted(commands, key=lambda c: c.name)


__all__ = ["Command", "get_commands"]
