"""Experimental trainers: newer methods built from the same pieces as the stable ones (data preparation,
losses, the online engine, generation backends). Their names, settings and behaviour may change between releases.

Each method lives in its own submodule with TRL's import path (`from trl.experimental.orpo import ORPOTrainer`
becomes `from posttrain.experimental.orpo import ORPOTrainer`): offline preference `orpo`, `cpo` (SimPO,
AlphaPO), `tpo`, `bco`; online preference `online_dpo`, `xpo`, `nash_md`; the GRPO family `gmpo`, `a2po`,
`grpo_with_replay_buffer`, `async_grpo`; distillation `gkd`, `gold`, `iw_opd`, `sdft`, `sdpo`,
`server_distillation` (a teacher served by vLLM), `async_distillation`; process rewards `prm`; agentic
environments for GRPO `harbor` and `openreward`; `judges`,
`winrate_callback`, `merge_model_callback`, `bema_for_ref_model`. XPO, Nash-MD, BCO, PRM, the replay buffer and the
judges were dropped from TRL in 2026; they are kept here for the users who still train with them. `kto` and
`distillation` keep TRL's deprecated paths of the stable KTO and distillation trainers (with a FutureWarning).

On-policy distillation (GKD, Agarwal et al. 2024) is now part of the stable DistillationTrainer (`lmbda`: the
fraction of micro-batches whose completions the student samples itself). The names below keep their older
defaults: half the micro-batches on-policy, 128 sampled tokens.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from posttrain.trainers.distillation import DistillationConfig, DistillationTrainer
from posttrain.training.fields import config_field


@dataclass
class OnPolicyDistillationConfig(DistillationConfig):
    lmbda: float = config_field(
        0.5,
        "Fraction of micro-batches whose completions the student samples itself (0: the data's completions "
        "only, 1: always the student's).",
    )
    max_new_tokens: int | None = config_field(
        128,
        "Most tokens the student samples per completion (overrides max_completion_length; None: use "
        "max_completion_length).",
        min=1,
    )

    def __post_init__(self):
        if self.max_new_tokens is not None:
            self.max_completion_length = self.max_new_tokens
        super().__post_init__()


class OnPolicyDistillationTrainer(DistillationTrainer):
    """`DistillationTrainer` with `OnPolicyDistillationConfig`'s defaults."""

    def __init__(self, model, teacher_model=None, args: OnPolicyDistillationConfig | None = None, *a, **kw):
        args = args or OnPolicyDistillationConfig(output_dir="outputs/on_policy_distillation")
        super().__init__(model, teacher_model, args, *a, **kw)


__all__ = ["OnPolicyDistillationConfig", "OnPolicyDistillationTrainer"]
