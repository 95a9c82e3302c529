"""Distillation from a teacher served remotely, with TRL's `trl.experimental.server_distillation` API.

The teacher is never loaded here: each micro-batch's sequences (prompt + completion, the student's own samples
or the data's, as in `DistillationTrainer`) are sent to an OpenAI-compatible vLLM server hosting the teacher
(`vllm serve TEACHER`, or `posttrain vllm-serve TEACHER`), whose `/v1/completions` route scores them without
generating (`prompt_logprobs`): per completion position, the teacher's top-`loss_top_k` tokens and its log-prob of
the token in the sequence. The divergence is therefore computed on a small support of token ids
(posttrain/losses/server_distillation.py): the teacher's top-k for forward KL (beta = 0), its top-1 and the
sampled token when beta > 0. Everything else (sampling, alpha's NLL mix, normalisation by the effective batch's
completion tokens, metrics) is `DistillationTrainer`'s. The server must use the student's tokenizer.
"""

from __future__ import annotations

from posttrain.errors import ConfigError
from posttrain.experimental.server_distillation.server_distillation_config import ServerDistillationConfig
from posttrain.generation.teacher_server import (
    TeacherServer,
    build_teacher_request_inputs,
    server_divergence,
    teacher_server_scores,
)
from posttrain.losses.iw_opd import add_tail_bucket as _add_tail_bucket
from posttrain.losses.iw_opd import jsd_terms as _jsd_divergence
from posttrain.trainers.distillation import DistillationTrainer


class ServerDistillationTrainer(DistillationTrainer):
    """`ServerDistillationTrainer(model, args=ServerDistillationConfig(teacher_model_server_url=...),
    train_dataset=...)`, TRL's keyword arguments in TRL's order. The server is reached once when the trainer is
    built, so a wrong address stops before any data is prepared."""

    _name = "Server Distillation"

    def __init__(
        self,
        model,
        args: ServerDistillationConfig | None = None,
        train_dataset=None,
        eval_dataset=None,
        processing_class=None,
        callbacks=None,
        optimizers=(None, None),
        quantization_config=None,
        peft_config=None,
        **kwargs,
    ):
        args = args or ServerDistillationConfig(output_dir="outputs/server_distillation")
        if kwargs.get("teacher_model") is not None or args.teacher_model_name_or_path is not None:
            raise ConfigError(
                "ServerDistillationTrainer's teacher is the one at teacher_model_server_url; drop "
                "teacher_model / teacher_model_name_or_path (or use DistillationTrainer for a local "
                "teacher)."
            )
        kwargs.pop("teacher_model", None)
        self.teacher_server = TeacherServer(args.teacher_model_server_url)
        super().__init__(
            model,
            None,
            args,
            train_dataset=train_dataset,
            eval_dataset=eval_dataset,
            processing_class=processing_class,
            callbacks=callbacks,
            optimizers=optimizers,
            quantization_config=quantization_config,
            peft_config=peft_config,
            **kwargs,
        )

    @staticmethod
    def _resolve_teacher(model, teacher_model, args):
        return None  # no local teacher

    def _divergence(self, inputs, student_logits, mask, temperature: float):
        """The sparse divergence against the server's log-probs at the masked positions (which predict the
        trained tokens), and the teacher's top-1 token there."""
        return server_divergence(self.teacher_server, self.args, inputs, student_logits, mask, temperature)


__all__ = [
    "ServerDistillationConfig",
    "ServerDistillationTrainer",
    "TeacherServer",
    "_add_tail_bucket",
    "_jsd_divergence",
    "build_teacher_request_inputs",
    "server_divergence",
    "teacher_server_scores",
]
