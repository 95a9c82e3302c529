"""AsyncDistillationConfig: the settings of the async_distillation trainer, at TRL's
`trl.experimental.async_distillation.async_distillation_config` path."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import ClassVar

from posttrain.errors import ConfigError
from posttrain.online.async_pipeline import (
    PIPELINE_UNSUPPORTED,
    AsyncPipelineFields,
)
from posttrain.online.engine import OnlineConfig
from posttrain.training.fields import config_field

DEFAULT_TEACHER_URL = "http://localhost:8001"


_NOT_A_POLICY_GRADIENT = "the distillation loss is a divergence to the teacher, not a clipped policy gradient."


@dataclass
class AsyncDistillationConfig(AsyncPipelineFields, OnlineConfig):
    """OnlineConfig with TRL's asynchronous-distillation fields and defaults (student on a vLLM server, teacher
    server(s), max_staleness 4, forward KL on the teacher's top 8 tokens plus a tail bucket)."""

    unsupported_options: ClassVar[dict[str, str]] = {
        **OnlineConfig.unsupported_options,
        **PIPELINE_UNSUPPORTED,
        "log_completions_steps": "log_completions writes every round's completions to output_dir/completions.jsonl.",
        "vllm_importance_sampling_correction": _NOT_A_POLICY_GRADIENT,
        "loss_type": _NOT_A_POLICY_GRADIENT,
        "epsilon": _NOT_A_POLICY_GRADIENT,
        "epsilon_high": _NOT_A_POLICY_GRADIENT,
        "importance_sampling_level": _NOT_A_POLICY_GRADIENT,
        "sync_ref_model": "there is no reference model: the teacher is the target.",
        "reward_weights": "the only reward is the logged teacher_logprob, which does not enter the loss.",
    }
    method: ClassVar[str] = "asynchronous distillation"

    num_generations: int = config_field(1, "Completions the student samples per prompt.")
    teacher_server_urls: dict | str | None = config_field(
        None,
        "Teacher vLLM server(s) as {name: url} (a JSON object on the command line), each serving a model with the "
        f"student's tokenizer; None: {DEFAULT_TEACHER_URL}, unless the trainer is given teacher_model. One entry "
        "only (several, TRL's multi-teacher MOPD, are not supported).",
    )
    beta: float = config_field(
        0.0,
        "Generalized JSD interpolation: 0 forward KL (teacher's top-k support), 1 reverse KL; in between the "
        "support is the teacher's top-1 and the sampled token.",
    )
    teacher_temperature: float = config_field(
        1.0, "Softmax temperature of both sides of the divergence (the student samples at `temperature`).", gt=0
    )
    teacher_top_k: int = config_field(8, "Teacher tokens per position the divergence compares.", min=1)
    add_tail_bucket: bool = config_field(
        True, "Compare the probability mass outside the support as one more element (else renormalise over it)."
    )
    vllm_importance_sampling_correction: bool = config_field(False, "Not used (only False).")
    log_completions_steps: int = config_field(
        100, "TRL: scored samples between two completion logs (posttrain logs every round; only the default)."
    )

    def __post_init__(self):
        self.resolve_async_pipeline()
        if isinstance(self.teacher_server_urls, str):
            self.teacher_server_urls = json.loads(self.teacher_server_urls)
        if self.teacher_server_urls is not None and len(self.teacher_server_urls) != 1:
            raise ConfigError(
                f"teacher_server_urls={self.teacher_server_urls}: posttrain distils from one teacher "
                "(TRL's multi-teacher MOPD with a teacher_id column is not supported); give one entry."
            )
        if not 0.0 <= self.beta <= 1.0:
            raise ConfigError(f"beta={self.beta} must be in [0, 1] (0: forward KL, 1: reverse KL).")
        super().__post_init__()
