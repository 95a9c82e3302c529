"""TRL's `trl.experimental.server_distillation.server_distillation_config` path: ServerDistillationConfig."""

from __future__ import annotations

from dataclasses import dataclass

from posttrain.errors import ConfigError
from posttrain.generation.teacher_server import START_HINT
from posttrain.trainers.distillation import DistillationConfig
from posttrain.training.fields import config_field


@dataclass
class ServerDistillationConfig(DistillationConfig):
    teacher_model_server_url: str | None = config_field(
        None, "Base URL of the vLLM server hosting the teacher, e.g. 'http://localhost:8000'. Required."
    )
    vllm_server_port: int = config_field(
        8001,
        "Port of the student's vLLM server (only with use_vllm); 8001 keeps it apart from the teacher's usual 8000.",
    )
    loss_top_k: int = config_field(
        1,
        "Teacher tokens per position the server reports and the divergence compares: any k >= 1 with beta=0 "
        "(forward KL), exactly 1 with beta > 0.",
        min=1,
    )
    loss_add_tail: bool = config_field(
        True,
        "Compare the mass outside the compared tokens as one more element (False: renormalise both "
        "distributions over the compared tokens).",
    )
    reverse_kl_top_1_mode: str = config_field(
        "sampled",
        "Which token the reverse-KL side of beta > 0 compares: 'sampled' (the completion's token; the only "
        "one a server can score).",
        choices=("sampled", "argmax"),
    )

    def __post_init__(self):
        if self.use_liger_kernel:
            raise ConfigError(
                "use_liger_kernel=True is not supported by ServerDistillationTrainer: a fused loss needs the "
                "teacher's full logits, and the server reports a few log-probs per position."
            )
        if self.reverse_kl_top_1_mode not in ("sampled", "argmax"):
            raise ConfigError(
                f"reverse_kl_top_1_mode must be one of ('sampled', 'argmax'), got {self.reverse_kl_top_1_mode!r}."
            )
        if self.reverse_kl_top_1_mode == "argmax":
            raise ConfigError(
                "reverse_kl_top_1_mode='argmax' is not supported: it compares the student's most likely token, "
                "which the teacher server cannot score (it reports its own top tokens and the sequence's). Use "
                "'sampled'."
            )
        if self.teacher_model_server_url is None or not self.teacher_model_server_url.strip():
            raise ConfigError(f"teacher_model_server_url must be set for ServerDistillationTrainer: {START_HINT}.")
        if self.beta > 0 and self.loss_top_k != 1:
            raise ConfigError(
                f"loss_top_k must be 1 with beta>0 (got loss_top_k={self.loss_top_k}, beta={self.beta}): with a "
                "reverse-KL part the support is the teacher's top-1 and the sampled token; set loss_top_k=1 (or "
                "beta=0)."
            )
        if self.padding_free or self.packing:
            raise ConfigError(
                "padding_free / packing: the teacher server scores each sequence on its own; set "
                "padding_free=False and packing=False."
            )
        super().__post_init__()
