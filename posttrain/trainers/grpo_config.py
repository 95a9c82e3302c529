"""`GRPOConfig`: the settings of GRPO and its relatives (DAPO, Dr. GRPO, GSPO, ...), with TRL's field names,
order, defaults and help."""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import ClassVar

from posttrain.errors import ConfigError
from posttrain.losses.advantages import (
    MULTI_OBJECTIVE_AGGREGATIONS,
    SCALE_REWARDS,
)
from posttrain.losses.policy import GRPO_LOSS_TYPES, loss_type_help
from posttrain.losses.token_weights import (
    IMPORTANCE_SAMPLING_MODES,
)
from posttrain.online.engine import OnlineConfig
from posttrain.training.fields import config_field


@dataclass
class GRPOConfig(OnlineConfig):
    """Settings of `GRPOTrainer`: generation, rewards, loss and vLLM options with TRL's names and defaults.

    OnlineConfig with GRPO's defaults: 8 generations per prompt, rewards scaled by their group's std,
    loss_type "dapo" (mean over all completion tokens of the optimizer step), no KL (beta=0).

    See docs/trainers/grpo.md.
    """

    min_num_generations: ClassVar[int] = 2
    method: ClassVar[str] = "GRPO"

    cast_lm_head_to_fp32: bool = config_field(
        False,
        "Keep the output layer of the policy and the reference in float32 and compute their logits in float32 "
        "(steadier log-probs when the model trains in bf16). A tied input embedding still outputs its dtype.",
    )
    delta: float | None = config_field(
        None,
        "Two-sided clipping (INTELLECT-2): also cap the unclipped ratio at delta, so negative advantages "
        "cannot push very large ratios further. None: off; else > 1 + epsilon.",
    )
    sapo_temperature_neg: float = config_field(
        1.05, "loss_type='sapo': temperature of the soft gate for tokens with advantage <= 0.", gt=0
    )
    sapo_temperature_pos: float = config_field(
        1.0, "loss_type='sapo': temperature of the soft gate for tokens with advantage > 0.", gt=0
    )
    vespo_k_pos: float = config_field(
        2.0, "loss_type='vespo', advantage >= 0: power k of the gamma weight w^k exp(-lambda w) (damps w < 1)."
    )
    vespo_lambda_pos: float = config_field(
        3.0, "loss_type='vespo', advantage >= 0: decay lambda of the gamma weight (damps w > 1)."
    )
    vespo_k_neg: float = config_field(3.0, "loss_type='vespo', advantage < 0: power k of the gamma weight.")
    vespo_lambda_neg: float = config_field(2.0, "loss_type='vespo', advantage < 0: decay lambda of the gamma weight.")
    multi_objective_aggregation: str = config_field(
        "sum_then_normalize",
        f"With several reward functions, one of {MULTI_OBJECTIVE_AGGREGATIONS}: sum the weighted rewards then "
        "normalise as scale_rewards says, or (GDPO) normalise each function within its group, sum with the "
        "weights, then normalise over the batch (scale_rewards is not used then).",
        choices=MULTI_OBJECTIVE_AGGREGATIONS,
    )
    scale_rewards: str = config_field(
        "group",
        f"Divide centred rewards by a std, one of {SCALE_REWARDS}: 'group' (the prompt's group; also True), "
        "'batch' (the whole generation batch), 'none' (Dr. GRPO; also False).",
        choices=SCALE_REWARDS,
    )
    loss_type: str = config_field("dapo", loss_type_help(GRPO_LOSS_TYPES), choices=GRPO_LOSS_TYPES)
    top_entropy_quantile: float = config_field(
        1.0,
        "Train only on the top fraction of completion tokens by entropy (rho in 'Beyond the 80/20 rule'; the "
        "paper uses 0.2). 1.0 keeps every token, 0.0 only the highest.",
        min=0,
        max=1,
    )
    entropy_coef: float = config_field(
        0.0,
        "Entropy bonus: subtract entropy_coef x the mean token entropy (over the trained tokens) from the "
        "loss, whatever the loss_type. With use_adaptive_entropy it is the starting coefficient.",
    )
    use_adaptive_entropy: bool = config_field(
        False,
        "Skywork-OR1's adaptive entropy control: after each optimizer step raise entropy_coef by "
        "entropy_coef_delta if the entropy was <= entropy_target, else lower it; the bonus applies only while "
        "the entropy is <= entropy_target. The coefficient is saved in checkpoints.",
    )
    entropy_coef_min: float = config_field(0.0, "Adaptive entropy control: lowest coefficient.")
    entropy_coef_max: float = config_field(1.0, "Adaptive entropy control: highest coefficient.")
    entropy_coef_delta: float = config_field(
        0.005, "Adaptive entropy control: change of the coefficient per optimizer step."
    )
    entropy_target: float = config_field(
        0.2,
        "Adaptive entropy control: target mean token entropy in nats, over the trained tokens. Language "
        "models usually sit at 2-10 nats; set it near the entropy seen early in training.",
    )
    vllm_importance_sampling_mode: str = config_field(
        "sequence_mask",
        f"How vLLM's sampling mismatch is corrected, one of {IMPORTANCE_SAMPLING_MODES}: a ratio per token or per "
        "sequence (product of token ratios); ratios outside [clip_min, clip_max] truncated to the range or set to "
        "0.",
        choices=IMPORTANCE_SAMPLING_MODES,
    )
    vllm_importance_sampling_clip_max: float | None = config_field(
        3.0, "Upper bound of the vLLM importance ratio (None: open)."
    )
    vllm_importance_sampling_clip_min: float | None = config_field(
        None, "Lower bound of the vLLM importance ratio (None: open)."
    )
    off_policy_mask_threshold: float | None = config_field(
        None,
        "DeepSeek-V3.2's off-policy sequence masking: drop completions with a negative advantage whose mean "
        "log(pi_sampler / pi) exceeds this (e.g. 0.5). None: off.",
        gt=0,
    )
    use_bias_correction_kl: bool = config_field(
        True,
        "Multiply the k3 KL term (beta > 0) by the importance ratio, which makes its gradient the unbiased "
        "reverse-KL gradient (DeepSeek-V3.2); changes the gradient even on-policy.",
    )
    dynamic_sampling: bool = config_field(
        False,
        "DAPO's dynamic sampling (verl: filter_groups): drop the groups whose rewards are all equal (zero "
        "advantage, nothing to learn) and generate for more prompts until the round holds only groups with "
        "reward variance, at most max_num_gen_batches generation batches per round; if still short, the round "
        "is completed with zero-variance groups. Logs dynamic_sampling/fill_rate and /num_gen_batches.",
    )
    max_num_gen_batches: int = config_field(
        3,
        "dynamic_sampling: the most generation batches (the round's own plus extra ones of the same size, for "
        "other prompts of the training set) generated for one round.",
    )
    vllm_importance_sampling_cap: float | None = config_field(
        None, "Deprecated alias of vllm_importance_sampling_clip_max (overrides it when set)."
    )

    def __post_init__(self):
        self.scale_rewards = {True: "group", False: "none"}.get(self.scale_rewards, self.scale_rewards)
        super().__post_init__()
        cap = self.vllm_importance_sampling_cap
        if cap is not None:
            warnings.warn(
                "vllm_importance_sampling_cap is deprecated: use vllm_importance_sampling_clip_max.",
                FutureWarning,
                stacklevel=3,
            )
            self.vllm_importance_sampling_clip_max = cap
        self._check_loss_options()

    def _check_loss_options(self) -> None:
        low, high = self.vllm_importance_sampling_clip_min, self.vllm_importance_sampling_clip_max
        if low is not None and high is not None and low >= high:
            raise ConfigError(
                f"vllm_importance_sampling_clip_min={low} must be below vllm_importance_sampling_clip_max={high}."
            )
        if (
            self.vllm_importance_sampling_correction
            and self.vllm_importance_sampling_mode.endswith("truncate")
            and low is None
            and high is None
        ):
            raise ConfigError(
                f"vllm_importance_sampling_mode={self.vllm_importance_sampling_mode!r} truncates the "
                "ratio to [clip_min, clip_max], but both are None: set "
                "vllm_importance_sampling_clip_max (e.g. 3.0)."
            )
        if (
            self.loss_type == "vespo"
            and self.use_vllm
            and self.vllm_importance_sampling_correction
            and not self.vllm_importance_sampling_mode.startswith("token")
        ):
            raise ConfigError(
                "loss_type='vespo' folds the vLLM correction into its per-token weights: set "
                "vllm_importance_sampling_mode to 'token_truncate' or 'token_mask' (it is "
                f"{self.vllm_importance_sampling_mode!r})."
            )
        level = self.importance_sampling_level
        if self.loss_type == "luspo" and level != "sequence":
            warnings.warn(
                "loss_type='luspo' is defined with importance_sampling_level='sequence' (the paper's setup).",
                stacklevel=4,
            )
        if self.loss_type == "vespo" and level != "token":
            warnings.warn(
                "loss_type='vespo' builds its own sequence weight from token ratios: keep "
                "importance_sampling_level='token'.",
                stacklevel=4,
            )
        if self.delta is not None and self.delta <= 1 + self.epsilon:
            raise ConfigError(
                f"delta={self.delta} caps the ratio for negative advantages and must exceed 1 + "
                f"epsilon = {1 + self.epsilon} (INTELLECT-2 uses 4), or be None (off)."
            )
        if self.dynamic_sampling and (self.max_num_gen_batches < 1 or self.num_generations < 2):
            raise ConfigError(
                f"dynamic_sampling=True needs max_num_gen_batches >= 1 (it is "
                f"{self.max_num_gen_batches}) and num_generations >= 2 (it is {self.num_generations})."
            )
        if self.use_adaptive_entropy and not (
            self.entropy_coef_min <= self.entropy_coef_max and self.entropy_coef_delta >= 0
        ):
            raise ConfigError(
                f"Adaptive entropy control needs entropy_coef_min ({self.entropy_coef_min}) <= "
                f"entropy_coef_max ({self.entropy_coef_max}) and entropy_coef_delta >= 0."
            )
