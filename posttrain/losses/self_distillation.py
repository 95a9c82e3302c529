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
        return generalized_jsd(student_logits, teacher_logits, alpha, None, temperature)
    if mode == "topk_logits":
        if not topk or topk < 1:
            raise ConfigError(f"distillation_mode='topk_logits' needs distillation_topk >= 1, got {topk}.")
        support = student_logits.topk(min(topk, student_logits.shape[-1]), dim=-1).indices
        valid = torch.ones_like(support, dtype=torch.bool)
        return support_divergence(student_logits, teacher_logits, support, valid, alpha, add_tail, temperature)
    if alpha != 1.0:
        raise ConfigError(
            f"distillation_mode='sampled_token' estimates reverse KL only: distillation_alpha must be 1.0, got {alpha}."
        )
    student = selective_log_softmax(student_logits / temperature, tokens)
    with torch.no_grad():
        teacher = selective_log_softmax(teacher_logits / temperature, tokens)
    return sampled_token_distillation(student, teacher)


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


__all__ = [
    "DISTILLATION_MODES",
    "sampled_token_distillation",
    "self_distillation_token_losses",
    "successful_demonstrations",
]
