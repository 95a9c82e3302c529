"""`posttrain <method> ...` (sft, dpo, grpo, ...) as a command object."""

from posttrain.cli.commands.base import PosttrainCommand


class TrainingCommand(PosttrainCommand):
    """`TrainingCommand("dpo")`: trains with the method's flags, as `posttrain dpo ...` does."""

    def __init__(self, name: str) -> None:
        super().__init__(name, f"Run the {name} training script")


__all__ = ["TrainingCommand"]
