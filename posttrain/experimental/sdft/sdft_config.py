"""TRL's `trl.experimental.sdft.sdft_config` path: SDFTConfig."""

from __future__ import annotations

from dataclasses import dataclass

from posttrain.errors import ConfigError
from posttrain.trainers.self_distillation import SelfDistillationConfig
from posttrain.training.fields import (
    config_field,
)


@dataclass
class SDFTConfig(SelfDistillationConfig):
    """TRL's SDFTConfig fields and defaults; posttrain's distillation and SFT settings around them."""

    generate_from_teacher: bool = config_field(
        False,
        "Sample completions from the teacher's prompt (with the student's weights) instead of the student's prompt.",
    )
    teacher_prompt_template: str = config_field(
        "{prompt}\n\n{privileged_context}",
        "How the teacher's prompt joins the prompt (the last user message's text for conversations) and the "
        "privileged context; needs both placeholders.",
    )
    num_loss_tokens_to_skip: int = config_field(
        0, "Leave the first this many completion tokens out of the loss.", min=0
    )

    def __post_init__(self):
        if "{prompt}" not in self.teacher_prompt_template or "{privileged_context}" not in self.teacher_prompt_template:
            raise ConfigError(
                f"teacher_prompt_template={self.teacher_prompt_template!r} needs both {{prompt}} and "
                "{privileged_context} placeholders."
            )
        super().__post_init__()
