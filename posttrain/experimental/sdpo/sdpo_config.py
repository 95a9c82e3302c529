"""SDPOConfig: the settings of the sdpo trainer, at TRL's `trl.experimental.sdpo.sdpo_config` path."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from posttrain.errors import ConfigError
from posttrain.losses.advantages import SCALE_REWARDS
from posttrain.trainers.self_distillation import SelfDistillationConfig
from posttrain.training.fields import config_field

LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo")


@dataclass
class SDPOConfig(SelfDistillationConfig):
    """TRL's SDPOConfig fields and defaults; posttrain's distillation and SFT settings around them."""

    unsupported_options: ClassVar[dict[str, str]] = {
        **SelfDistillationConfig.unsupported_options,
        "beta": "TRL 1.16's SDPO stores beta but never adds a KL term (no reference model is loaded); posttrain "
        "refuses a non-zero value rather than ignore it. Keep beta=0.0.",
    }

    beta: float = config_field(0.0, "KL coefficient (not applied by SDPO: keep 0.0).")
    epsilon: float = config_field(0.2, "Lower clip range of the policy ratio.")
    epsilon_high: float | None = config_field(None, "Upper clip range of the policy ratio (None: epsilon).")
    importance_sampling_level: str = config_field(
        "token", "Policy ratio per 'token' or per 'sequence' (GSPO).", choices=("token", "sequence")
    )
    reward_weights: list[float] | None = config_field(None, "One weight per reward function (None: all 1.0).")
    scale_rewards: str = config_field(
        "group",
        "Advantage scaling: 'group' std, 'batch' std or 'none' (True/False: 'group'/'none').",
        choices=SCALE_REWARDS,
    )
    loss_type: str = config_field(
        "dapo",
        "Policy-loss aggregation: 'grpo' (per completion, then mean), 'bnpo' / 'dapo' (per token of the "
        "micro-batch), 'dr_grpo' (by max length).",
        choices=LOSS_TYPES,
    )
    mask_truncated_completions: bool = config_field(
        False, "Leave completions cut at max_completion_length out of the loss."
    )
    distillation_weight: float = config_field(
        1.0, "Loss = (1 - w) * policy loss + w * distillation loss; 1.0 distils only.", min=0, max=1
    )
    distillation_alpha: float = config_field(1.0, "Divergence: 0 forward KL, 1 reverse KL (sampled_token needs 1.0).")
    distillation_mode: str = config_field(
        "sampled_token", "'sampled_token' (reverse KL on the sample), 'full_logits' or 'topk_logits'."
    )
    distillation_topk: int | None = config_field(
        None, "topk_logits: how many of the student's most likely tokens to compare."
    )
    teacher_model_kind: str = config_field(
        "ema",
        "The teacher: 'ema' (moving average of the student), 'base' (the initial student) or 'live' (the "
        "current student).",
    )
    max_reprompt_len: int = config_field(
        10240, "Keep at most this many tokens (the last ones) of a teacher prompt.", min=1
    )
    use_successful_as_teacher: bool = config_field(
        True, "Re-ask the teacher with a successful sibling completion as the solution."
    )
    success_reward_threshold: float = config_field(
        1.0, "A completion with at least this reward is a successful demonstration."
    )
    dont_reprompt_on_self_success: bool = config_field(True, "Never use a completion as its own demonstration.")
    reprompt_template: str = config_field(
        "{prompt}{solution}{feedback}\n\nCorrectly solve the original question.\n",
        "The teacher's prompt, from {prompt}, {solution} and {feedback}.",
    )
    solution_template: str = config_field(
        "\nCorrect solution:\n\n{successful_previous_attempt}\n\n",
        "How a successful demonstration ({successful_previous_attempt}) is shown.",
    )
    feedback_template: str = config_field(
        "\nThe following is feedback from your unsuccessful earlier attempt:\n\n{feedback_raw}\n\n",
        "How environment feedback ({feedback_raw}) is shown.",
    )
    include_environment_feedback: bool = config_field(
        False, "Show the row's privileged_context (feedback) to the teacher."
    )
    environment_feedback_only_without_solution: bool = config_field(
        False, "Show feedback only when no successful demonstration exists."
    )
    remove_thinking_from_demonstration: bool = config_field(
        False, "Drop <think>...</think> blocks from demonstrations."
    )
    diagnostics_warning_interval: int = config_field(
        10, "Warn every this many consecutive steps without any distilled completion (0: never)."
    )
    diagnostics_flat_tolerance: float = config_field(
        1e-8, "Reward std / reprompt fraction at or below this counts as zero."
    )

    def __post_init__(self):
        self.scale_rewards = {True: "group", False: "none", "true": "group", "false": "none"}.get(
            self.scale_rewards, self.scale_rewards
        )
        if self.epsilon_high is None:
            self.epsilon_high = self.epsilon
        super().__post_init__()
        if self.world_size > 1 and self.per_device_train_batch_size % self.num_generations:
            raise ConfigError(
                f"With {self.world_size} processes each micro-batch must hold whole groups: make "
                f"per_device_train_batch_size ({self.per_device_train_batch_size}) a multiple of "
                f"num_generations ({self.num_generations})."
            )
