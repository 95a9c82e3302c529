"""Distillation from a teacher that only reports log-probabilities of a few tokens per position (a vLLM server's
`prompt_logprobs`: its top-k tokens and the token actually in the sequence), as in TRL's
`trl.experimental.server_distillation`.

The divergence is the generalized JSD of distillation (beta = 0: forward KL(p_T‖p_S), 1: reverse KL(p_S‖p_T))
between the two distributions restricted to a small support S of token ids, either renormalised over S or with
one more element holding the mass outside S (`add_tail`, so that a one-token support still compares something):

- beta = 0: S = the teacher's top-k tokens (those it reported);
- beta = 1: S = the sampled token x_t (the teacher's log-prob of it is reported);
- 0 < beta < 1: S = {teacher's top-1 token, x_t} (x_t counted once when they coincide).

Per-position values are returned; the trainer sums them over the completion tokens.
"""

from __future__ import annotations

import torch

from posttrain.losses.iw_opd import divergence_on_support


def server_support(
    topk_ids: torch.Tensor,
    topk_logps: torch.Tensor,
    sampled_ids: torch.Tensor,
    sampled_logps: torch.Tensor,
    beta: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(support ids [..., K'], the teacher's log-probs there, valid mask) from what the server reported: its top-k
    ids and log-probs [..., k] (-inf where it reported fewer) and its log-prob of the sampled tokens [...]."""
    if beta == 0:
        return topk_ids, topk_logps, torch.isfinite(topk_logps)
    if beta == 1:
        return (
            sampled_ids.unsqueeze(-1),
            sampled_logps.unsqueeze(-1),
            torch.ones_like(sampled_ids, dtype=torch.bool)[..., None],
        )
    support = torch.stack([topk_ids[..., 0], sampled_ids], -1)
    valid = torch.ones_like(support, dtype=torch.bool)
    valid[..., 1] = support[..., 1] != support[..., 0]
    teacher = torch.stack([topk_logps[..., 0], sampled_logps], -1)
    return torch.where(valid, support, 0), teacher, valid


def sparse_teacher_divergence(
    student_logits: torch.Tensor,
    support: torch.Tensor,
    teacher_logps: torch.Tensor,
    valid: torch.Tensor,
    beta: float,
    add_tail: bool = True,
    temperature: float = 1.0,
) -> torch.Tensor:
    """Per position [...]: the generalized JSD between the student's softmax(logits / temperature) [..., V] and
    the teacher's log-probs `teacher_logps` [..., K], both restricted to the ids `support` [..., K] where `valid`."""
    dtype = torch.float64 if student_logits.dtype == torch.float64 else torch.float32
    student = (student_logits.to(dtype) / temperature).log_softmax(-1).gather(-1, support)
    return divergence_on_support(student, teacher_logps.to(dtype), valid, beta, add_tail)


__all__ = ["server_support", "sparse_teacher_divergence"]
