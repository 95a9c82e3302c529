"""TRL's `trl.experimental.gold.gold_config` path: GOLDConfig."""

from __future__ import annotations

import json
from dataclasses import dataclass

from posttrain.errors import ConfigError
from posttrain.losses.gold import MERGE_STRATEGIES
from posttrain.trainers.distillation import DistillationConfig
from posttrain.training.fields import (
    config_field,
    disable_dropout_field,
    learning_rate_field,
    max_completion_length_field,
    remove_unused_columns_field,
)


@dataclass
class GOLDConfig(DistillationConfig):
    # TRL's GOLDConfig is an SFTConfig (True); the trainer names its collator's columns as SFT's does
    remove_unused_columns: bool = remove_unused_columns_field()
    learning_rate: float = learning_rate_field(1e-7)
    temperature: float = config_field(
        0.9,
        "Sampling temperature, and the temperature of both distributions in the generalized JSD (not in ULD: "
        "see uld_*_temperature).",
    )
    top_p: float = config_field(0.95, "Nucleus sampling of on-policy completions (1.0: off).")
    lmbda: float = config_field(0.5, "Probability that a micro-batch's completions are sampled by the student.")
    beta: float = config_field(0.5, "Generalized JSD interpolation: 0 = forward KL, 0.5 = JSD, 1 = reverse KL.")
    max_completion_length: int = max_completion_length_field(128, "Most tokens sampled per completion.")
    shuffle_dataset: bool = config_field(
        False, "Shuffle the prepared dataset once with `seed` (batches are drawn in random order either way)."
    )
    teacher_tokenizer_name_or_path: str | None = config_field(
        None, "The teacher's tokenizer for ULD (default: the teacher's own)."
    )
    disable_dropout: bool = disable_dropout_field(True, "Switch off dropout in the student.")
    seq_kd: bool = config_field(False, "Micro-batches that are not on-policy train on the teacher's samples.")
    num_generations: int = config_field(1, "Completions per prompt (only 1 is supported by posttrain's GOLD).")
    generation_batch_size: int | None = config_field(
        None,
        "Prompts per process per optimizer step (None: per_device_train_batch_size * "
        "gradient_accumulation_steps / num_generations, the only value allowed).",
    )
    use_uld_loss: bool = config_field(
        False, "Universal Logit Distillation instead of the generalized JSD (for a teacher with a different tokenizer)."
    )
    uld_token_merge_strategy: str = config_field(
        "observed",
        "How several tokens aligned to one are merged: 'observed' (first position x later tokens' "
        "probabilities) or 'bayesian' (last position x earlier tokens' probabilities).",
        choices=MERGE_STRATEGIES,
    )
    use_extended_uld: bool = config_field(
        True, "Align the tokenizations by byte offsets (False: position by position)."
    )
    uld_use_hybrid_loss: bool = config_field(
        False, "Hybrid ULD: the generalized JSD (beta) on the tokens both vocabularies share, sorted L1 on the others."
    )
    uld_hybrid_matched_weight: float | None = config_field(
        None, "Hybrid ULD weight of the shared tokens (only with uld_use_hybrid_loss).", min=0
    )
    uld_hybrid_unmatched_weight: float | None = config_field(
        None, "Hybrid ULD weight of the other tokens (only with uld_use_hybrid_loss).", min=0
    )
    uld_crossentropy_weight: float = config_field(
        0.0, "Weight of the student's NLL of the completions in the ULD loss.", min=0
    )
    uld_distillation_weight: float = config_field(1.0, "Weight of the ULD term.", min=0)
    uld_student_temperature: float = config_field(1.0, "Student softmax temperature in ULD.", gt=0)
    uld_teacher_temperature: float = config_field(1.0, "Teacher softmax temperature in ULD.", gt=0)
    uld_skip_student_eos: bool = config_field(True, "Leave the student completion's last token out of ULD.")
    uld_skip_teacher_eos: bool = config_field(True, "Leave the teacher completion's last token (its EOS) out of ULD.")
    vllm_server_port: int = config_field(8001, "vLLM server port (only with use_vllm).")
    vllm_gpu_memory_utilization: float = config_field(0.9, "Colocated vLLM GPU memory share (only with use_vllm).")
    vllm_sync_frequency: int = config_field(1, "Steps between weight syncs to vLLM (only with use_vllm).")
    log_completions_steps: int = config_field(
        100, "With log_completions: save the latest completions every this many steps.", min=1
    )
    wandb_log_unique_prompts: bool = config_field(True, "With log_completions: show each prompt's completion once.")
    callbacks: list[str] = config_field(
        help="TRL's unused callback names; pass callback objects to the trainer's `callbacks` argument instead.",
        default_factory=list,
    )

    def __post_init__(self):
        if isinstance(self.callbacks, str):
            self.callbacks = json.loads(self.callbacks)
        if self.callbacks:
            raise ConfigError(
                f"callbacks={self.callbacks}: GOLDConfig.callbacks is not read by TRL's or posttrain's "
                "GOLDTrainer. Pass callback objects as GOLDTrainer(callbacks=[...]) and leave it empty."
            )
        if self.num_generations != 1:
            raise ConfigError(
                f"num_generations={self.num_generations}: posttrain's GOLD samples one completion per "
                "prompt. Set num_generations=1 (repeat prompts in the dataset for more samples)."
            )
        local = self.per_device_train_batch_size * self.gradient_accumulation_steps
        if self.generation_batch_size not in (None, local):
            raise ConfigError(
                f"generation_batch_size={self.generation_batch_size} must equal "
                f"per_device_train_batch_size * gradient_accumulation_steps ({local}) with one "
                "generation per prompt; leave it None."
            )
        self.generation_batch_size = local
        weights = (self.uld_hybrid_matched_weight, self.uld_hybrid_unmatched_weight)
        if (weights[0] is None) != (weights[1] is None):
            raise ConfigError(
                f"uld_hybrid_matched_weight={weights[0]}, uld_hybrid_unmatched_weight={weights[1]}: "
                "set both (fixed weights) or neither (weights from the shared vocabulary fraction)."
            )
        if self.max_length is not None and self.max_completion_length >= self.max_length:
            raise ConfigError(
                f"max_completion_length={self.max_completion_length} must be smaller than max_length="
                f"{self.max_length} to leave room for the prompt."
            )
        if self.use_uld_loss and (self.padding_free or self.packing):
            raise ConfigError(
                "use_uld_loss=True aligns each row's completion with the teacher's tokenization; set "
                "padding_free=False and packing=False."
            )
        self.log_unique_prompts = self.wandb_log_unique_prompts
        super().__post_init__()
