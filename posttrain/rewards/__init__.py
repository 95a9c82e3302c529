"""Reward functions: the ready-made library and the sandbox that runs generated code.

`REWARD_FUNCTIONS` maps the names accepted on the command line (`--reward_funcs accuracy_reward`) to ready-to-use
functions; rewards that need settings (overlong length, length-scaled correctness, a fixed JSON schema, other
n-gram sizes or sandbox limits) come from the `get_*` factories. `accuracy_rewards`, `format_rewards` and
`other_rewards` are TRL's module paths for the same functions.
"""

from posttrain.rewards.library import (
    RewardFunction,
    accuracy_reward,
    code_execution_reward,
    completion_text,
    extract_code,
    get_code_execution_reward,
    get_json_schema_reward,
    json_reward,
    json_schema_reward,
    reasoning_accuracy_reward,
    think_format_reward,
)
from posttrain.rewards.sandbox import SANDBOXES, SandboxResult, check_sandbox, run_many, run_python, sandbox_backend
from posttrain.rewards.shaping import (
    CosineScaledReward,
    RepetitionPenalty,
    SoftOverlongPunishment,
    get_cosine_scaled_reward,
    get_repetition_penalty_reward,
    get_soft_overlong_punishment,
)

REWARD_FUNCTIONS: dict[str, RewardFunction] = {
    "accuracy_reward": accuracy_reward,
    "reasoning_accuracy_reward": reasoning_accuracy_reward,
    "think_format_reward": think_format_reward,
    "repetition_penalty_reward": get_repetition_penalty_reward(),
    "json_reward": json_reward,
    "json_schema_reward": json_schema_reward,
    "code_execution_reward": code_execution_reward,
}

__all__ = [
    "REWARD_FUNCTIONS",
    "CosineScaledReward",
    "RepetitionPenalty",
    "SoftOverlongPunishment",
    "get_cosine_scaled_reward",
    "RewardFunction",
    "SANDBOXES",
    "SandboxResult",
    "accuracy_reward",
    "check_sandbox",
    "code_execution_reward",
    "completion_text",
    "extract_code",
    "get_code_execution_reward",
    "get_json_schema_reward",
    "get_repetition_penalty_reward",
    "get_soft_overlong_punishment",
    "json_reward",
    "json_schema_reward",
    "reasoning_accuracy_reward",
    "run_many",
    "run_python",
    "sandbox_backend",
    "think_format_reward",
]
