"""Knowledge distillation: the student learns to match a frozen teacher's next-token distributions on the
completion tokens of the data (Hinton et al. 2015; GKD's generalized JSD, Agarwal et al. 2024), optionally
mixed with the plain NLL of the data.

Data is prepared exactly as for SFT (text, prompt-completion or conversations; completion / assistant masks;
padding-free and packing): the trainer is an SFTTrainer whose per-batch loss sum is

    alpha * sum_t JSD_beta(p_T(. | x_<t) ‖ p_S(. | x_<t)) + (1 - alpha) * sum_t -log p_S(x_t | x_<t)

over trained tokens, divided by the trained tokens of the whole effective batch. The teacher sees the
same token ids as the student, so the two must share a tokenizer (checked before training).
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass, field

import torch
from transformers import PreTrainedModel

from ..errors import ConfigError
from ..losses.distillation import check_vocab_sizes, generalized_jsd, shared_vocab
from ..losses.sft import IGNORE_INDEX, nll_sum, shift_for_next_token
from ..models.loading import load_causal_lm, load_tokenizer
from ..models.reference import freeze
from .sft import SFTConfig, SFTTrainer, uses_flash_attention

logger = logging.getLogger("posttrain")


@dataclass
class DistillationConfig(SFTConfig):
    teacher_model_name_or_path: str | None = field(
        default=None, metadata={"help": "The teacher (hub id, path or built-in name), used when no teacher_model "
                                        "is passed to the trainer."})
    teacher_model_init_kwargs: dict | str | None = field(
        default=None, metadata={"help": "Keyword arguments for from_pretrained when the teacher is given by name "
                                        "or path, e.g. {'dtype': 'bfloat16'}."})
    temperature: float = field(
        default=1.0, metadata={"help": "Both distributions are softmax(logits / temperature); above 1 softens them."})
    beta: float = field(
        default=0.5, metadata={"help": "Generalized JSD interpolation: 0 = forward KL(teacher‖student), "
                                       "0.5 = Jensen-Shannon, 1 = reverse KL(student‖teacher)."})
    alpha: float = field(
        default=1.0, metadata={"help": "Weight of the distillation loss; 1 - alpha weighs the NLL of the data "
                                       "(1 = pure distillation, 0 = plain SFT)."})

    def __post_init__(self):
        if isinstance(self.teacher_model_init_kwargs, str):
            self.teacher_model_init_kwargs = json.loads(self.teacher_model_init_kwargs)
        if self.temperature <= 0:
            raise ConfigError(f"temperature={self.temperature} must be > 0 (1.0 leaves the distributions as they are).")
        if not 0 <= self.beta <= 1:
            raise ConfigError(f"beta={self.beta} must lie in [0, 1] (0: forward KL, 0.5: JSD, 1: reverse KL).")
        if not 0 <= self.alpha <= 1:
            raise ConfigError(f"alpha={self.alpha} must lie in [0, 1] (1: pure distillation, 0: plain NLL).")
        if self.chunked_loss:
            raise ConfigError("chunked_loss=True is not available for distillation: the divergence needs the full "
                              "logits of student and teacher. Set chunked_loss=False.")
        super().__post_init__()


def _name(model: str | PreTrainedModel) -> str:
    return model if isinstance(model, str) else (model.name_or_path or type(model).__name__)


def _teacher_tokenizer(teacher: str | PreTrainedModel, given):
    """The teacher's tokenizer: the one passed, else the one saved with the teacher, else None (unknown)."""
    if given is not None:
        return given
    if isinstance(teacher, str) or os.path.isdir(teacher.name_or_path):
        return load_tokenizer(teacher if isinstance(teacher, str) else teacher.name_or_path)
    return None


def check_teacher_compatible(student: PreTrainedModel, student_tokenizer, teacher: PreTrainedModel,
                             teacher_tokenizer) -> None:
    """Raises ConfigError unless every student id means the same token to the teacher and has a teacher logit.

    The tokenizers must agree on the ids the student can predict (the teacher may have more ids beyond the
    student's vocabulary, e.g. padding of its output layer: they are cut off). Without the teacher's
    tokenizer only the vocabulary sizes can be checked.
    """
    student_vocab = student.config.get_text_config().vocab_size
    teacher_vocab = teacher.config.get_text_config().vocab_size
    check_vocab_sizes(student_vocab, teacher_vocab)
    if teacher_tokenizer is None:
        logger.warning("The teacher %r comes without a tokenizer (pass teacher_processing_class): only its "
                       "vocabulary size was checked against the student's.", _name(teacher))
        return
    student_ids = student_tokenizer.get_vocab()
    teacher_ids = {token: i for token, i in teacher_tokenizer.get_vocab().items() if i < student_vocab}
    if student_ids != teacher_ids:
        differing = sorted(set(student_ids.items()) ^ set(teacher_ids.items()), key=lambda pair: pair[1])[:3]
        raise ConfigError(
            f"The student's tokenizer ({_name(student)}, {len(student_tokenizer)} tokens, vocabulary size "
            f"{student_vocab}) and the teacher's ({_name(teacher)}, {len(teacher_tokenizer)} tokens, vocabulary "
            f"size {teacher_vocab}) give different tokens for the same ids (e.g. token/id pairs in one but not the "
            f"other: {differing}), so their next-token distributions cannot be compared. Distil from a teacher "
            "that shares the student's tokenizer."
        )


class DistillationTrainer(SFTTrainer):
    """`DistillationTrainer(model, teacher_model, args=DistillationConfig(...), train_dataset=...,
    processing_class=..., peft_config=..., teacher_processing_class=None)`.

    `teacher_model` is a model, hub id, path or built-in name (default: args.teacher_model_name_or_path); it
    is loaded with `teacher_model_init_kwargs`, frozen and kept in eval mode. Logged per micro-batch, as means
    over trained tokens: distill_loss, nll, teacher_agreement (student and teacher top-1 tokens equal) and
    SFT's mean_token_accuracy.
    """

    def __init__(self, model, teacher_model=None, args: DistillationConfig | None = None, *a,
                 teacher_processing_class=None, **kw):
        args = args or DistillationConfig(output_dir="outputs/distillation")
        if teacher_model is not None and args.teacher_model_name_or_path is not None:
            raise ConfigError(f"Two teachers: teacher_model={_name(teacher_model)!r} and "
                              f"teacher_model_name_or_path={args.teacher_model_name_or_path!r}; give only one.")
        teacher_model = teacher_model if teacher_model is not None else args.teacher_model_name_or_path
        if teacher_model is None:
            raise ConfigError("DistillationTrainer needs a teacher: pass teacher_model (a model, hub id or path) or "
                              "set teacher_model_name_or_path in the config.")
        if teacher_model is model:
            raise ConfigError("teacher_model is the student itself, so freezing it would stop training. Pass a "
                              "separately loaded teacher.")
        if not isinstance(teacher_model, str) and args.teacher_model_init_kwargs:
            raise ConfigError("teacher_model_init_kwargs only applies when the teacher is given by name or path; "
                              "the teacher you passed is already loaded. Drop teacher_model_init_kwargs.")
        super().__init__(model, args, *a, **kw)
        teacher = load_causal_lm(teacher_model, args.teacher_model_init_kwargs)
        check_teacher_compatible(self.model, self.processing_class, teacher,
                                 _teacher_tokenizer(teacher_model, teacher_processing_class))
        self.teacher_model = self.accelerator.prepare_model(freeze(teacher), evaluation_mode=True)
        # The teacher reads the same batches: a flash-attention teacher needs them in one row too.
        if self.data_collator is self._own_collator:
            self.data_collator.one_row = uses_flash_attention(self.model) or uses_flash_attention(teacher)

    def _forward_nll(self, model, inputs, labels):
        """SFT's hook for the loss sum over trained tokens: here the alpha-mix of divergence and NLL."""
        student_logits = model(**inputs).logits
        with torch.no_grad():
            teacher_logits = shared_vocab(student_logits, self.teacher_model(**inputs).logits)
        mask = shift_for_next_token(labels) != IGNORE_INDEX
        divergence = generalized_jsd(student_logits, teacher_logits, self.args.beta, mask,
                                     self.args.temperature).sum()
        nll, correct, count = nll_sum(student_logits, labels)
        agree = (student_logits[mask].argmax(-1) == teacher_logits[mask].argmax(-1)).sum()
        totals = self.accelerator.gather(torch.stack([divergence.detach(), nll.detach(), agree.float(),
                                                      count.float()]).reshape(1, 4)).sum(0)
        means = (totals[:3] / totals[3].clamp(min=1)).tolist()
        metrics = self._metrics["train" if model.training else "eval"]
        for key, value in zip(("distill_loss", "nll", "teacher_agreement"), means):
            metrics[key].append(value)
        return self.args.alpha * divergence + (1 - self.args.alpha) * nll, correct, count
