"""Self-distillation (SDFT, Shenfeld et al. 2026; SDPO, Hübotter et al. 2026): the student is distilled from itself
conditioned on more information (a demonstration, or a successful sibling rollout), on completions it sampled
without that information.

Per completion token t, with p_S the student's next-token distribution given the plain prompt and p_T the teacher's
given the enriched prompt (both at the same temperature), the objective is one of

- "full_logits": the generalized JSD over the whole vocabulary, alpha*KL(p_T‖m) + (1-alpha)*KL(p_S‖m) with
  m = alpha*p_T + (1-alpha)*p_S (alpha=0: forward KL(p_T‖p_S), alpha=1: reverse KL(p_S‖p_T));
- "topk_logits": the same divergence on the student's k most likely tokens, renormalised there, or with the
  mass outside them as one more element (add_tail);
- "sampled_token": a single-sample estimate of reverse KL on the sampled token x_t,
  loss_t = sg(log p_S(x_t) - log p_T(x_t)) * log p_S(x_t), whose gradient is that of KL(p_S‖p_T) in expectation.

Losses are returned per token; the trainer averages them per completion, then over completions.
"""

from __future__ import annotations

import torch

from posttrain.errors import ConfigError
from posttrain.losses.distillation import generalized_jsd
from posttrain.losses.iw_opd import support_divergence
from posttrain.losses.logprobs import selective_log_softmax

DISTILLATION_MODES = ("sampled_token", "full_logits", "topk_logits")


def sampled_token_distillation(student_logps: torch.Tensor, teacher_logps: torch.Tensor) -> torch.Tensor:
    """Per-token sg(log p_S - log p_T) * log p_S on the sampled tokens' log-probabilities."""
    return (student_logps - teacher_logps).detach() * student_logps


def full_logit_self_distillation(
    student_logits: torch.Tensor, teacher_logits: torch.Tensor, *, distillation_alpha: float, temperature: float = 1.0
) -> torch.Tensor:
    """ "full_logits": the generalized JSD over the whole vocabulary per position, [...] from logits [..., V]."""
    return generalized_jsd(student_logits, teacher_logits, distillation_alpha, None, temperature)


def topk_self_distillation(
    student_logits: torch.Tensor,
    teacher_logits: torch.Tensor,
    *,
    distillation_topk: int,
    distillation_alpha: float,
    distillation_add_tail: bool,
    temperature: float = 1.0,
) -> torch.Tensor:
    """ "topk_logits": the generalized JSD on the student's `distillation_topk` most likely tokens per position,
    renormalised there, or with the mass outside them as one more element (`distillation_add_tail`)."""
    if not distillation_topk or distillation_topk < 1:
        raise ConfigError(f"distillation_mode='topk_logits' needs distillation_topk >= 1, got {distillation_topk}.")
    support = student_logits.topk(min(distillation_topk, student_logits.shape[-1]), dim=-1).indices
    valid = torch.ones_like(support, dtype=torch.bool)
    return support_divergence(
        student_logits, teacher_logits, support, valid, distillation_alpha, distillation_add_tail, temperature
    )


def sampled_token_self_distillation(
    student_logits: torch.Tensor,
    teacher_logits: torch.Tensor,
    completion_ids: torch.Tensor,
    *,
    distillation_alpha: float,
    temperature: float = 1.0,
) -> torch.Tensor:
    """ "sampled_token": the single-sample reverse-KL estimate at the sampled tokens `completion_ids` [...]."""
    if distillation_alpha != 1.0:
        raise ConfigError(
            "distillation_mode='sampled_token' estimates reverse KL only: distillation_alpha must be 1.0, "
            f"got {distillation_alpha}."
        )
    student = selective_log_softmax(student_logits / temperature, completion_ids)
    with torch.no_grad():
        teacher = selective_log_softmax(teacher_logits / temperature, completion_ids)
    return sampled_token_distillation(student, teacher)


def importance_sampling_clipped(
    per_token_loss: torch.Tensor, student_logps: torch.Tensor, old_logps: torch.Tensor, clip_coeff: float
) -> torch.Tensor:
    """`per_token_loss` weighted by the importance ratio p_S / p_old of each sampled token (no gradient through it),
    capped at `clip_coeff`: completions sampled by an older policy count as much as the current one would sample
    them, never more than `clip_coeff` times. The log-ratio is clamped to [-20, 20] first, so it cannot overflow."""
    log_ratio = (student_logps - old_logps).detach().clamp(-20.0, 20.0)
    return per_token_loss * log_ratio.exp().clamp(max=clip_coeff)


def self_distillation_token_losses(
    student_logits: torch.Tensor,
    teacher_logits: torch.Tensor,
    tokens: torch.Tensor,
    mode: str,
    alpha: float,
    topk: int | None = None,
    add_tail: bool = False,
    temperature: float = 1.0,
) -> torch.Tensor:
    """The per-token loss [...] for logits [..., V] at the positions that predict `tokens` [...] (see the module)."""
    if mode not in DISTILLATION_MODES:
        raise ConfigError(f"distillation_mode={mode!r} is not one of {DISTILLATION_MODES}.")
    if mode == "full_logits":
        return full_logit_self_distillation(
            student_logits, teacher_logits, distillation_alpha=alpha, temperature=temperature
        )
    if mode == "topk_logits":
        return topk_self_distillation(
            student_logits,
            teacher_logits,
            distillation_topk=topk,
            distillation_alpha=alpha,
            distillation_add_tail=add_tail,
            temperature=temperature,
        )
    return sampled_token_self_distillation(
        student_logits, teacher_logits, tokens, distillation_alpha=alpha, temperature=temperature
    )


def successful_demonstrations(
    rewards: list[float], num_generations: int, threshold: float, exclude_self: bool = True
) -> list[int | None]:
    """SDPO's teacher context: for each rollout, the index of the first rollout of its group (consecutive blocks of
    `num_generations`) whose reward reaches `threshold` (itself excluded when `exclude_self`), or None."""
    if len(rewards) % num_generations:
        raise ConfigError(f"{len(rewards)} rollouts do not split into groups of num_generations={num_generations}.")
    sources: list[int | None] = []
    for i in range(len(rewards)):
        start = i - i % num_generations
        found = [
            j
            for j in range(start, start + num_generations)
            if rewards[j] >= threshold and not (exclude_self and j == i)
        ]
        sources.append(found[0] if found else None)
    return sources


def logps_divergence(student_logps: torch.Tensor, teacher_logps: torch.Tensor, alpha: float) -> torch.Tensor:
    """The generalized JSD per position between two log-distributions [..., V] (summed over the last dim): alpha 0
    is KL(teacher || student), 1 is KL(student || teacher), in between the divergence to the mixture
    alpha * teacher + (1 - alpha) * student (GKD's beta, posttrain.losses.distillation.generalized_jsd)."""
    from posttrain.losses.distillation import generalized_jsd

    return generalized_jsd(student_logps, teacher_logps, beta=alpha)


def with_tail_bucket(logps: torch.Tensor) -> torch.Tensor:
    """Log-probs on a top-k support [..., K] plus one bucket holding the mass outside it, log(1 - sum p) (the sum
    kept just below 1 so the tail stays finite): a distribution [..., K + 1] that sums to 1."""
    inside = torch.logsumexp(logps, -1, keepdim=True).clamp(max=-1e-7)
    return torch.cat([logps, torch.log(-torch.expm1(inside))], -1)


__all__ = [
    "logps_divergence",
    "with_tail_bucket",
    "DISTILLATION_MODES",
    "full_logit_self_distillation",
    "importance_sampling_clipped",
    "sampled_token_distillation",
    "sampled_token_self_distillation",
    "self_distillation_token_losses",
    "successful_demonstrations",
    "topk_self_distillation",
]
