"""The `posttrain` command's subcommands as objects, in TRL's `trl.cli.commands` shape: each registers its parser
and runs through `posttrain.cli.main.main`, so both forms behave the same."""

from __future__ import annotations

from abc import ABC, abstractmethod
from argparse import Namespace
from dataclasses import dataclass


@dataclass(slots=True)
class CommandContext:
    """The whole command line a subcommand runs from."""

    argv: list[str]

    def argv_after(self, token: str) -> list[str]:
        """The arguments after the first `token` (the subcommand's name); [] when it is absent."""
        return self.argv[self.argv.index(token) + 1 :] if token in self.argv else []


class Command(ABC):
    """A subcommand: `name` on the command line, `help_text` in the help."""

    def __init__(self, name: str, help_text: str) -> None:
        self.name, self.help_text = name, help_text

    def register(self, subparsers) -> None:
        """Adds this command to `subparsers` (argparse's `add_subparsers()`); its own flags are parsed on `run`."""
        subparsers.add_parser(self.name, help=self.help_text, add_help=False)

    @abstractmethod
    def run(self, args: Namespace, context: CommandContext) -> int:
        """Runs the command with the arguments after its name in `context.argv`; returns the exit status."""


class PosttrainCommand(Command):
    """A subcommand run by `posttrain <name> <arguments>`."""

    def run(self, args: Namespace, context: CommandContext) -> int:
        from posttrain.cli.main import main

        return main([self.name, *context.argv_after(self.name)])


__all__ = ["Command", "CommandContext", "PosttrainCommand"]
