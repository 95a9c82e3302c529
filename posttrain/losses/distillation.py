"""Token-level divergences between a teacher's and a student's next-token distributions (knowledge
distillation, GKD: Agarwal et al. 2024).

Every function takes logits [..., V] of both models and returns the divergence summed over the
vocabulary at each position, shape [...], 0 where `mask` is False. Returning per-token values (not a
mean) lets the trainer divide by the trained tokens of the whole effective batch, as for the NLL.
Both distributions are softmax(logits / temperature), computed in float32 (float64 stays float64).
Only masked-in positions are computed, so padding never produces NaNs or costs time.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from posttrain.errors import ConfigError

Divergence = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def _kl(log_p: torch.Tensor, log_q: torch.Tensor) -> torch.Tensor:
    """sum_v p_v (log p_v - log q_v); terms with p_v = 0 count 0 (so -inf logits are allowed)."""
    p = log_p.exp()
    return torch.where(p > 0, p * (log_p - log_q), 0.0).sum(-1)


def _per_token(
    divergence: Divergence,
    student_logits: torch.Tensor,
    teacher_logits: torch.Tensor,
    mask: torch.Tensor | None,
    temperature: float,
) -> torch.Tensor:
    """Applies `divergence(student_logps, teacher_logps)` at the positions in `mask`; zeros elsewhere."""
    if student_logits.shape != teacher_logits.shape:
        raise ConfigError(
            f"Student logits {tuple(student_logits.shape)} and teacher logits "
            f"{tuple(teacher_logits.shape)} differ in shape; align the vocabularies with shared_vocab."
        )
    if temperature <= 0:
        raise ConfigError(f"temperature={temperature} must be > 0 (1.0 leaves the distributions as they are).")
    if mask is None:
        mask = torch.ones(student_logits.shape[:-1], dtype=torch.bool, device=student_logits.device)
    mask = mask.bool()
    dtype = torch.float64 if student_logits.dtype == torch.float64 else torch.float32
    student = (student_logits[mask].to(dtype) / temperature).log_softmax(-1)
    teacher = (teacher_logits[mask].to(dtype) / temperature).log_softmax(-1)
    out = torch.zeros(mask.shape, dtype=dtype, device=student_logits.device)
    return out.masked_scatter(mask, divergence(student, teacher))


def forward_kl(
    student_logits: torch.Tensor,
    teacher_logits: torch.Tensor,
    mask: torch.Tensor | None = None,
    temperature: float = 1.0,
) -> torch.Tensor:
    """KL(teacher ‖ student) per position: mode-covering, the classic distillation loss."""
    return _per_token(lambda s, t: _kl(t, s), student_logits, teacher_logits, mask, temperature)


def reverse_kl(
    student_logits: torch.Tensor,
    teacher_logits: torch.Tensor,
    mask: torch.Tensor | None = None,
    temperature: float = 1.0,
) -> torch.Tensor:
    """KL(student ‖ teacher) per position: mode-seeking, the student concentrates on the teacher's modes."""
    return _per_token(_kl, student_logits, teacher_logits, mask, temperature)


def generalized_jsd(
    student_logits: torch.Tensor,
    teacher_logits: torch.Tensor,
    beta: float = 0.5,
    mask: torch.Tensor | None = None,
    temperature: float = 1.0,
) -> torch.Tensor:
    """GKD's generalized Jensen-Shannon divergence per position:

        JSD_beta = beta * KL(p_T ‖ m) + (1 - beta) * KL(p_S ‖ m),   m = beta * p_T + (1 - beta) * p_S.

    JSD_beta itself vanishes at both ends, but JSD_beta / beta -> KL(p_T ‖ p_S) as beta -> 0 and
    JSD_beta / (1 - beta) -> KL(p_S ‖ p_T) as beta -> 1, so beta = 0 is forward KL and beta = 1 is reverse
    KL (GKD's convention); beta = 0.5 is the symmetric Jensen-Shannon divergence.
    """
    if not 0.0 <= beta <= 1.0:
        raise ConfigError(f"beta={beta} must lie in [0, 1] (0: forward KL, 0.5: Jensen-Shannon, 1: reverse KL).")
    if beta == 0.0:
        return forward_kl(student_logits, teacher_logits, mask, temperature)
    if beta == 1.0:
        return reverse_kl(student_logits, teacher_logits, mask, temperature)

    def jsd(student: torch.Tensor, teacher: torch.Tensor) -> torch.Tensor:
        mixture = torch.logaddexp(teacher + math.log(beta), student + math.log1p(-beta))
        return beta * _kl(teacher, mixture) + (1 - beta) * _kl(student, mixture)

    return _per_token(jsd, student_logits, teacher_logits, mask, temperature)


def generalized_jsd_loss(
    student_logits: torch.Tensor,
    teacher_logits: torch.Tensor,
    labels: torch.Tensor | None = None,
    beta: float = 0.5,
    temperature: float = 1.0,
    reduction: str = "batchmean",
    num_items_in_batch: int | torch.Tensor | None = None,
    logits_are_probs: bool = False,
) -> torch.Tensor:
    """`generalized_jsd` with TRL's GKD interface: the divergence's terms per vocabulary entry ([B, T, V], in the
    logits' dtype), positions whose label is -100 dropped, then reduced: "batchmean" divides the sum by the number of
    labelled positions (by the batch size without labels), "sum", "mean" (over the remaining terms), "none" (the
    terms, [B, T, V] without labels); `num_items_in_batch` divides the sum by that count instead. With
    `logits_are_probs` (TRL's GOLD) the inputs are probabilities already (floored at 1e-8 before the log, no
    temperature)."""
    if not 0.0 <= beta <= 1.0:
        raise ConfigError(f"beta={beta} must lie in [0, 1] (0: forward KL, 0.5: Jensen-Shannon, 1: reverse KL).")
    if logits_are_probs:
        student, teacher = student_logits.clamp_min(1e-8).log(), teacher_logits.clamp_min(1e-8).log()
    else:
        student = (student_logits / temperature).log_softmax(-1)
        teacher = (teacher_logits / temperature).log_softmax(-1)

    def kl_terms(log_p, log_q):  # p (log p - log q) per entry, 0 where p = 0
        p = log_p.exp()
        return torch.where(p > 0, p * (log_p - log_q), torch.zeros_like(p))

    if beta == 0.0:
        terms = kl_terms(teacher, student)
    elif beta == 1.0:
        terms = kl_terms(student, teacher)
    else:
        mixture = torch.logaddexp(teacher + math.log(beta), student + math.log1p(-beta))
        terms = beta * kl_terms(teacher, mixture) + (1 - beta) * kl_terms(student, mixture)
    return reduce_divergence_terms(terms, labels, reduction, num_items_in_batch)


def reduce_divergence_terms(
    terms: torch.Tensor,
    labels: torch.Tensor | None = None,
    reduction: str = "batchmean",
    num_items_in_batch: int | torch.Tensor | None = None,
) -> torch.Tensor:
    """A divergence's terms [B, T, K] reduced as TRL's distillation losses do: positions whose label is -100
    dropped, then "batchmean" (the sum over the labelled positions' count, or the batch size without labels),
    "sum", "mean" (over the remaining terms) or "none" (the terms); `num_items_in_batch` divides the sum instead."""
    mask = None
    if labels is not None:
        mask = labels != -100
        terms = terms[mask]
    if num_items_in_batch is not None:
        return terms.sum() / num_items_in_batch
    if reduction == "batchmean":
        count = mask.sum().clamp_min(1) if mask is not None else max(terms.shape[0], 1)
        return terms.sum() / count
    if reduction == "sum":
        return terms.sum()
    if reduction == "mean":
        return terms.mean()
    if reduction == "none":
        return terms
    raise ConfigError(f"reduction={reduction!r} is not one of 'batchmean', 'sum', 'mean', 'none'.")


def shared_vocab(student_logits: torch.Tensor, teacher_logits: torch.Tensor) -> torch.Tensor:
    """The teacher's logits over the student's vocabulary ids.

    Models often pad their output layer beyond the tokenizer (to a multiple of 64, say); a teacher whose
    padded vocabulary is larger than the student's is cut to the student's ids, which assumes that the
    two tokenizers agree on those ids (the trainer checks). A smaller teacher vocabulary cannot be aligned.
    """
    check_vocab_sizes(student_logits.shape[-1], teacher_logits.shape[-1])
    return teacher_logits[..., : student_logits.shape[-1]]


def check_vocab_sizes(student_vocab: int, teacher_vocab: int) -> None:
    """Raises ConfigError unless the teacher has logits for every student id (see `shared_vocab`)."""
    if teacher_vocab < student_vocab:
        raise ConfigError(
            f"The teacher's vocabulary size ({teacher_vocab} logits) is smaller than the student's "
            f"({student_vocab} logits), so the student's ids cannot all be scored by the teacher. Use a teacher "
            "with the student's tokenizer and at least as many output logits."
        )
