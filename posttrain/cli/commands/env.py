"""`posttrain env` as a command object."""

from posttrain.cli.commands.base import PosttrainCommand


class EnvCommand(PosttrainCommand):
    """Prints the versions of posttrain, its dependencies and the accelerator."""

    def __init__(self) -> None:
        super().__init__("env", "Print the environment information")


__all__ = ["EnvCommand"]
