"""TRL"s former `trl.experimental.judges` path; the judges live in posttrain.rewards.judges."""

from posttrain.rewards.judges import (
    DEFAULT_PAIRWISE_SYSTEM_PROMPT,
    AllTrueJudge,
    BaseBinaryJudge,
    BaseJudge,
    BasePairwiseJudge,
    BaseRankJudge,
    CausalLMPairwiseJudge,
    HfPairwiseJudge,
    OpenAIPairwiseJudge,
    PairRMJudge,
    RewardModelPairwiseJudge,
    ScoringPairwiseJudge,
)

__all__ = [
    "AllTrueJudge",
    "BaseBinaryJudge",
    "BaseJudge",
    "BasePairwiseJudge",
    "BaseRankJudge",
    "CausalLMPairwiseJudge",
    "DEFAULT_PAIRWISE_SYSTEM_PROMPT",
    "HfPairwiseJudge",
    "OpenAIPairwiseJudge",
    "PairRMJudge",
    "RewardModelPairwiseJudge",
    "ScoringPairwiseJudge",
]
