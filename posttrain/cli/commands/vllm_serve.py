"""`posttrain vllm-serve MODEL` as a command object."""

from posttrain.cli.commands.base import PosttrainCommand


class VllmServeCommand(PosttrainCommand):
    """Starts the vLLM server of server-mode online training."""

    def __init__(self) -> None:
        super().__init__("vllm-serve", "Serve a model with vLLM for server-mode training")


__all__ = ["VllmServeCommand"]
