"""Importance-weighted on-policy distillation (IW-OPD, TRL's `trl.experimental.iw_opd`) and the sparse-support
divergences its JSD objective uses.

IW-OPD treats the teacher's log-ratio on each sampled token as an advantage, a_t = log p_T(x_t) - log p_R(x_t)
(p_R: the policy that sampled the rollout), and weights the early tokens of a completion more, by how much of the
completion's total |a| is still ahead:

    w_t = 1 + gamma * (1 - sum_{s<t} |a_s| / max(sum_s |a_s|, eps)),   loss_t = -log p_S(x_t) * w_t * a_t

with a and w treated as constants (a policy-gradient step towards the teacher). Every function returns values per
token, 0 where `mask` is False, so the trainer divides by the trained tokens of the effective batch.
"""

from __future__ import annotations

import torch

from posttrain.losses.distillation import generalized_jsd_loss, reduce_divergence_terms


def iw_opd_token_losses(
    student_logps: torch.Tensor,
    teacher_logps: torch.Tensor,
    mask: torch.Tensor,
    gamma: float = 0.5,
    eps: float = 1e-8,
    rollout_logps: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(per-token loss, advantages w_t * a_t, weights w_t), each [B, T], for the log-probabilities [B, T] of the
    sampled tokens under the student, the teacher and (default: the student's, detached) the rollout policy."""
    mask = mask.bool()
    rollout = (student_logps if rollout_logps is None else rollout_logps).detach()
    ratio = torch.where(mask, teacher_logps.detach() - rollout, 0.0)
    size = ratio.abs()
    before = size.cumsum(-1) - size
    total = size.sum(-1, keepdim=True).clamp_min(eps)
    weights = 1.0 + gamma * (1.0 - before / total)
    advantages = weights * ratio
    return torch.where(mask, -student_logps * advantages, 0.0), advantages, weights


def add_tail_bucket(logps: torch.Tensor, valid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(logps [..., K+1], valid [..., K+1]): the log-probs on a support [..., K] with one more element holding the
    mass outside it, log(1 - sum p) (the sum kept just below 1 so the tail stays finite), always valid."""
    inside = torch.logsumexp(logps, -1, keepdim=True).clamp(max=-1e-7)
    return torch.cat([logps, torch.log(-torch.expm1(inside))], -1), torch.cat([valid, valid[..., :1] | True], -1)


def jsd_terms(
    student: torch.Tensor, teacher: torch.Tensor, beta: float, support_mask: torch.Tensor | None = None
) -> torch.Tensor:
    """The generalized JSD's terms per element [..., K] (sum them over K for the divergence) between two
    log-distributions: beta=0 p_T (log p_T - log p_S) (forward KL), beta=1 p_S (log p_S - log p_T) (reverse KL),
    else beta p_T (log p_T - log m) + (1 - beta) p_S (log p_S - log m) with m = beta p_T + (1 - beta) p_S.
    Elements outside `support_mask` (None: all in) count 0, whatever their log-probs (-inf included)."""
    valid = torch.ones_like(student, dtype=torch.bool) if support_mask is None else support_mask
    zero = torch.zeros_like(student)
    s_log, t_log = torch.where(valid, student, zero), torch.where(valid, teacher, zero)
    s_p, t_p = torch.where(valid, student.exp(), zero), torch.where(valid, teacher.exp(), zero)
    if beta == 0:
        terms = t_p * (t_log - s_log)
    elif beta == 1:
        terms = s_p * (s_log - t_log)
    else:
        mixture = torch.where(valid, ((1 - beta) * s_p + beta * t_p).clamp_min(torch.finfo(s_p.dtype).tiny).log(), zero)
        terms = beta * t_p * (t_log - mixture) + (1 - beta) * s_p * (s_log - mixture)
    return torch.nan_to_num(terms, nan=0.0)


def support_divergence(
    student_logits: torch.Tensor,
    teacher_logits: torch.Tensor,
    support: torch.Tensor,
    valid: torch.Tensor,
    beta: float,
    add_tail: bool = True,
    temperature: float = 1.0,
) -> torch.Tensor:
    """Generalized JSD (0: forward KL, 1: reverse KL) per position between the two distributions restricted to the
    token ids `support` [..., K] (`valid` marks the ids to use, e.g. not duplicates): renormalised over the support,
    or with one more element holding the rest of the mass (`add_tail`)."""
    dtype = torch.float64 if student_logits.dtype == torch.float64 else torch.float32
    student = (student_logits.to(dtype) / temperature).log_softmax(-1).gather(-1, support)
    teacher = (teacher_logits.to(dtype) / temperature).log_softmax(-1).gather(-1, support)
    return divergence_on_support(student, teacher, valid, beta, add_tail)


def divergence_on_support(
    student: torch.Tensor, teacher: torch.Tensor, valid: torch.Tensor, beta: float, add_tail: bool
) -> torch.Tensor:
    """Generalized JSD per position from the two log-probs at the support ids [..., K] (full-vocabulary
    log-probs, read where `valid`): renormalised over the support, or with the rest of the mass as one more
    element (`add_tail`)."""
    student = torch.where(valid, student, float("-inf"))
    teacher = torch.where(valid, teacher, float("-inf"))
    if add_tail:
        (student, valid_tail), (teacher, _) = add_tail_bucket(student, valid), add_tail_bucket(teacher, valid)
        valid = valid_tail
    else:
        student = student - torch.logsumexp(student, -1, keepdim=True)
        teacher = teacher - torch.logsumexp(teacher, -1, keepdim=True)
    return jsd_terms(student, teacher, beta, valid).sum(-1)


def top_k_support(
    student_logits: torch.Tensor, teacher_logits: torch.Tensor, k: int, beta: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """The ids a top-k divergence compares: the teacher's top k (beta=0), the student's (beta=1), or the teacher's
    then the student's with repeats marked invalid (0 < beta < 1)."""
    if beta == 0:
        support = teacher_logits.topk(k, -1).indices
    elif beta == 1:
        support = student_logits.topk(k, -1).indices
    else:
        support = torch.cat([teacher_logits.topk(k, -1).indices, student_logits.topk(k, -1).indices], -1)
    return _first_occurrences(support)


def top1_mixed_support(
    teacher_logits: torch.Tensor, reverse_ids: torch.Tensor, beta: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """IW-OPD's mixed top-1 support: the token `reverse_ids` (the sampled one, or the student's argmax) alone for
    beta=1, else the teacher's argmax then that token (invalid when they coincide)."""
    if beta == 1:
        support = reverse_ids.unsqueeze(-1)
        return support, torch.ones_like(support, dtype=torch.bool)
    return _first_occurrences(torch.stack([teacher_logits.argmax(-1), reverse_ids], -1))


def _first_occurrences(support: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`support` with repeated ids replaced by id 0 and marked invalid."""
    valid = torch.ones_like(support, dtype=torch.bool)
    for i in range(1, support.shape[-1]):
        valid[..., i] = ~(support[..., i : i + 1] == support[..., :i]).any(-1)
    return torch.where(valid, support, torch.zeros_like(support)), valid


def top_k_generalized_jsd_loss(
    student_logits: torch.Tensor,
    teacher_logits: torch.Tensor,
    labels: torch.Tensor | None = None,
    beta: float = 0.5,
    temperature: float = 1.0,
    reduction: str = "batchmean",
    top_k: int = 0,
    add_tail: bool = True,
    num_items_in_batch: int | torch.Tensor | None = None,
) -> torch.Tensor:
    """TRL's IW-OPD `generalized_jsd_loss`: with top_k = 0 (or top_k >= the vocabulary) GKD's
    `generalized_jsd_loss`; else the same generalized JSD on the support of `top_k_support` (the teacher's top k,
    the student's, or both), renormalised over it or with the rest of the mass as one more element (`add_tail`).
    The terms [B, T, K'] are reduced by `reduce_divergence_terms`."""
    if top_k <= 0 or student_logits.shape[-1] <= top_k:
        return generalized_jsd_loss(
            student_logits, teacher_logits, labels, beta, temperature, reduction, num_items_in_batch
        )
    student_logits, teacher_logits = student_logits / temperature, teacher_logits / temperature
    support, valid = top_k_support(student_logits, teacher_logits, top_k, beta)
    student = torch.where(valid, student_logits.log_softmax(-1).gather(-1, support), float("-inf"))
    teacher = torch.where(valid, teacher_logits.log_softmax(-1).gather(-1, support), float("-inf"))
    if add_tail:
        (student, tail_valid), (teacher, _) = add_tail_bucket(student, valid), add_tail_bucket(teacher, valid)
        valid = tail_valid
    else:
        student = student - torch.logsumexp(student, -1, keepdim=True)
        teacher = teacher - torch.logsumexp(teacher, -1, keepdim=True)
    terms = jsd_terms(student, teacher, beta, valid)
    return reduce_divergence_terms(terms, labels, reduction, num_items_in_batch)
