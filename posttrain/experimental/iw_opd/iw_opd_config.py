"""TRL's `trl.experimental.iw_opd.iw_opd_config` path: IWOPDConfig."""

from __future__ import annotations

from dataclasses import dataclass

from posttrain.errors import ConfigError
from posttrain.trainers.distillation import DistillationConfig
from posttrain.training.fields import (
    config_field,
    disable_dropout_field,
    max_completion_length_field,
    max_prompt_length_field,
)

OBJECTIVES = ("iw_opd", "jsd")


@dataclass
class IWOPDConfig(DistillationConfig):
    remove_unused_columns: bool = config_field(
        True, "TRL's default; the trainer sets it to False (every column reaches the collator), as TRL's does."
    )
    distillation_objective: str = config_field(
        "iw_opd",
        "'iw_opd' (importance-weighted policy gradient on the teacher's log-ratio) or 'jsd' (generalized JSD, "
        "see loss_top_k).",
        choices=OBJECTIVES,
    )
    iw_opd_gamma: float = config_field(
        0.5,
        "How much more early tokens weigh: w_t = 1 + gamma * (share of the completion's |log-ratio| still ahead).",
        min=0,
    )
    iw_opd_epsilon: float = config_field(1e-8, "Floor of the per-completion |log-ratio| sum.", gt=0)
    reverse_kl_top_1_mode: str = config_field(
        "sampled",
        "The student-side token of the mixed top-1 JSD: 'sampled' (the completion's token) or 'argmax' (the "
        "student's most likely).",
        choices=("sampled", "argmax"),
    )
    max_completion_length: int = max_completion_length_field(512, "Most tokens sampled per completion.")
    max_prompt_length: int | None = max_prompt_length_field(
        None,
        "Cut prompts to this many tokens, on the tokenizer's truncation side (default: max_length - "
        "max_completion_length).",
    )
    disable_dropout: bool = disable_dropout_field(True, "Switch off dropout in the student.")
    use_teacher_server: bool = config_field(
        False,
        "Score with a teacher on a vLLM server (teacher_model_server_url) instead of a local teacher_model, through "
        "ServerDistillationTrainer's client.",
    )
    teacher_model_server_url: str | None = config_field(
        None, "With use_teacher_server: the teacher server's base URL, e.g. 'http://localhost:8000'."
    )
    loss_top_k: int = config_field(
        1,
        "JSD objective: compare the distributions on this many top tokens (0: the full vocabulary; 1 with "
        "beta > 0: the mixed top-1 support).",
        min=0,
    )
    loss_add_tail: bool = config_field(
        True, "JSD on a top-k support: add the remaining mass as one more element (else renormalise over the support)."
    )
    num_generations: int = config_field(1, "Completions per prompt (only 1 is supported by posttrain's IW-OPD).")
    generation_batch_size: int | None = config_field(
        None,
        "Prompts per process per optimizer step (None: the local batch, the only value allowed with one "
        "generation per prompt).",
    )
    top_p: float = config_field(0.95, "Nucleus sampling of on-policy completions (1.0: off).")
    vllm_server_port: int = config_field(8001, "vLLM server port (only with use_vllm).")
    vllm_sync_frequency: int = config_field(1, "Steps between weight syncs to vLLM (only with use_vllm).")
    log_completions_steps: int = config_field(
        100, "With log_completions: save the latest completions every this many steps.", min=1
    )

    def _check_objective(self) -> None:
        if self.distillation_objective not in OBJECTIVES:
            raise ConfigError(
                f"distillation_objective must be one of {OBJECTIVES}, got {self.distillation_objective!r}."
            )
        if self.iw_opd_gamma < 0:
            raise ConfigError(f"iw_opd_gamma must be non-negative, got {self.iw_opd_gamma}.")
        if self.iw_opd_epsilon <= 0:
            raise ConfigError(f"iw_opd_epsilon must be positive, got {self.iw_opd_epsilon}.")
        if self.reverse_kl_top_1_mode not in ("sampled", "argmax"):
            raise ConfigError(
                f"reverse_kl_top_1_mode must be one of ('sampled', 'argmax'), got {self.reverse_kl_top_1_mode!r}."
            )
        if self.distillation_objective != "iw_opd":
            return
        if self.use_liger_kernel:
            raise ConfigError(
                "use_liger_kernel=True is not supported with distillation_objective='iw_opd': the fused kernel "
                "computes the JSD, not IW-OPD's policy-gradient loss. Set use_liger_kernel=False."
            )
        if self.lmbda < 1:
            raise ConfigError(
                f"distillation_objective='iw_opd' requires lmbda=1.0 (got {self.lmbda}): it weighs the "
                "student's own samples."
            )
        if self.reverse_kl_top_1_mode != "sampled":
            raise ConfigError(
                "distillation_objective='iw_opd' requires reverse_kl_top_1_mode='sampled': its tokens are "
                "the sampled ones."
            )

    def _check_teacher_server(self) -> None:
        """TRL's rules for its teacher server."""
        if not self.use_teacher_server:
            return
        if self.use_liger_kernel:
            raise ConfigError("use_liger_kernel=True is not supported with use_teacher_server=True.")
        if self.teacher_model_server_url is None or not self.teacher_model_server_url.strip():
            raise ConfigError("teacher_model_server_url must be set when use_teacher_server=True.")
        if self.reverse_kl_top_1_mode == "argmax":
            raise ConfigError(
                "reverse_kl_top_1_mode='argmax' is not supported with use_teacher_server=True: a teacher "
                "server cannot score tokens the student picks."
            )
        if self.beta > 0 and self.loss_top_k != 1:
            raise ConfigError(
                f"loss_top_k must be 1 when using use_teacher_server=True with beta>0 (got {self.loss_top_k})."
            )
        if self.distillation_objective == "jsd" and self.loss_top_k == 0:
            raise ConfigError(
                "loss_top_k=0 compares the full vocabulary, which a teacher server does not report (it gives a few "
                "log-probs per position); set loss_top_k >= 1 with use_teacher_server=True."
            )

    def __post_init__(self):
        self._check_teacher_server()
        self._check_objective()
        if self.max_length is not None and self.max_completion_length >= self.max_length:
            raise ConfigError(
                f"max_completion_length={self.max_completion_length} must be smaller than max_length="
                f"{self.max_length} to leave room for the prompt."
            )
        if self.max_prompt_length is None and self.max_length is not None:
            self.max_prompt_length = self.max_length - self.max_completion_length
        if self.num_generations != 1:
            raise ConfigError(
                f"num_generations={self.num_generations}: posttrain's IW-OPD samples one completion per "
                "prompt. Set num_generations=1 (repeat prompts in the dataset for more samples)."
            )
        local = self.per_device_train_batch_size * self.gradient_accumulation_steps
        if self.generation_batch_size not in (None, local):
            raise ConfigError(
                f"generation_batch_size={self.generation_batch_size} must equal "
                f"per_device_train_batch_size * gradient_accumulation_steps ({local}); leave it None."
            )
        self.generation_batch_size = local
        super().__post_init__()
