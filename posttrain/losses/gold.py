"""Universal Logit Distillation (ULD, Boizard et al. 2024, "Towards Cross-Tokenizer Distillation: the Universal Logit
Distillation Loss for LLMs") as GOLD uses it: a teacher and a student with different tokenizers.

Their vocabularies do not correspond, so ULD compares each position's probabilities sorted in decreasing order:

    ULD(p_S, p_T) = sum_k | sort(p_S)_k - sort(p_T)_k |      (the shorter vocabulary padded with zeros)

averaged over the aligned positions of a completion. The completions are tokenized differently, so positions are
first aligned ("extended ULD"): walking both tokenizations' byte offsets, a group closes wherever both reach the
same byte boundary. A group of several tokens is merged into one (unnormalised) distribution by the chain rule:
'observed' takes the first position's distribution times the probabilities of the actual later tokens, 'bayesian'
the last position's distribution (read one position earlier, where that token is predicted) times those of the
actual earlier tokens. Without alignment the first min(len) positions are compared one to one.
"""

from __future__ import annotations

import math

import torch

from posttrain.errors import ConfigError

MERGE_STRATEGIES = ("observed", "bayesian")
_EPS = 1e-8


def align_by_byte_offsets(student_offsets, teacher_offsets) -> tuple[list[list[int]], list[list[int]]]:
    """Groups of student and teacher token positions covering the same bytes. Offsets are (start, end) byte pairs
    in a shared coordinate system (relative to the completion). Tokens left over once one side runs out form one
    last pair of groups (either may be empty)."""
    student_groups, teacher_groups = [], []
    s = t = s_open = t_open = 0
    while s < len(student_offsets) and t < len(teacher_offsets):
        s_end, t_end = student_offsets[s][1], teacher_offsets[t][1]
        s += s_end <= t_end
        t += t_end <= s_end
        if s_end == t_end:
            student_groups.append(list(range(s_open, s)))
            teacher_groups.append(list(range(t_open, t)))
            s_open, t_open = s, t
    if s < len(student_offsets) or t < len(teacher_offsets):
        student_groups.append(list(range(s_open, len(student_offsets))))
        teacher_groups.append(list(range(t_open, len(teacher_offsets))))
    return student_groups, teacher_groups


def merge_groups(
    probs: torch.Tensor, groups: list[list[int]], token_ids: list[int], strategy: str = "observed"
) -> torch.Tensor:
    """[groups, V]: one distribution per group (see the module docstring); an empty group gives zeros."""
    if strategy not in MERGE_STRATEGIES:
        raise ConfigError(f"uld_token_merge_strategy={strategy!r} is not one of {MERGE_STRATEGIES}.")
    rows = []
    for group in groups:
        if not group:
            rows.append(torch.zeros_like(probs[0]))
            continue
        base, others = (group[-1], group[:-1]) if strategy == "bayesian" else (group[0], group[1:])
        row = probs[base]
        for k in others:
            row = row * probs[k, token_ids[k]].clamp_min(_EPS)
        rows.append(row)
    return torch.stack(rows) if rows else probs[:0]


def sorted_l1(student_probs: torch.Tensor, teacher_probs: torch.Tensor) -> torch.Tensor:
    """ULD's distance between [N, V_S] and [N, V_T] distributions: the L1 distance of the probabilities sorted in
    decreasing order (zero-padded to the larger vocabulary), summed over positions and divided by N."""
    width = max(student_probs.shape[-1], teacher_probs.shape[-1])
    student = torch.nn.functional.pad(
        student_probs.sort(-1, descending=True).values, (0, width - student_probs.shape[-1])
    )
    teacher = torch.nn.functional.pad(
        teacher_probs.sort(-1, descending=True).values, (0, width - teacher_probs.shape[-1])
    )
    return (student - teacher).abs().sum() / student_probs.shape[0]


def shared_token_ids(student_vocab: dict[str, int], teacher_vocab: dict[str, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(teacher ids, student ids) of the token strings both vocabularies hold, in increasing teacher id."""
    pairs = sorted((t, student_vocab[token]) for token, t in teacher_vocab.items() if token in student_vocab)
    return torch.tensor([t for t, _ in pairs], dtype=torch.long), torch.tensor([s for _, s in pairs], dtype=torch.long)


def _probability_jsd(student: torch.Tensor, teacher: torch.Tensor, beta: float) -> torch.Tensor:
    """Generalized JSD summed over [N, M] (unnormalised) probabilities, log(p) floored at log(1e-8), / N."""
    s_log, t_log = student.clamp_min(_EPS).log(), teacher.clamp_min(_EPS).log()
    if beta == 0:
        terms = t_log.exp() * (t_log - s_log)
    elif beta == 1:
        terms = s_log.exp() * (s_log - t_log)
    else:
        mixture = torch.logaddexp(s_log + math.log1p(-beta), t_log + math.log(beta))
        terms = beta * t_log.exp() * (t_log - mixture) + (1 - beta) * s_log.exp() * (s_log - mixture)
    return terms.sum() / max(student.shape[0], 1)


def hybrid_uld(
    student_probs: torch.Tensor,
    teacher_probs: torch.Tensor,
    shared: tuple[torch.Tensor, torch.Tensor],
    beta: float,
    matched_weight: float | None = None,
    unmatched_weight: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(loss, matched part, unmatched part) of hybrid ULD on aligned [N, V_S] / [N, V_T] distributions: the
    generalized JSD on the probabilities of the tokens both vocabularies share (`shared`: teacher ids, student ids),
    ULD's sorted L1 on the others. Without weights they are weighed by the shared fraction of the teacher's
    vocabulary and its complement."""
    teacher_ids, student_ids = (ids.to(student_probs.device) for ids in shared)
    matched = (
        _probability_jsd(student_probs[:, student_ids], teacher_probs[:, teacher_ids], beta)
        if len(teacher_ids)
        else student_probs.sum() * 0.0
    )
    t_rest = torch.ones(teacher_probs.shape[-1], dtype=torch.bool, device=teacher_probs.device)
    s_rest = torch.ones(student_probs.shape[-1], dtype=torch.bool, device=student_probs.device)
    t_rest[teacher_ids], s_rest[student_ids] = False, False
    unmatched = (
        sorted_l1(student_probs[:, s_rest], teacher_probs[:, t_rest])
        if t_rest.any() and s_rest.any()
        else student_probs.sum() * 0.0
    )
    if matched_weight is None:
        matched_weight = len(teacher_ids) / max(1, teacher_probs.shape[-1])
        unmatched_weight = 1.0 - matched_weight
    return matched_weight * matched + unmatched_weight * unmatched, matched, unmatched


def _span(labels: torch.Tensor) -> tuple[int, int]:
    trained = (labels != -100).nonzero()
    return (int(trained[0]), len(trained)) if len(trained) else (0, 0)


def uld_sequence_parts(
    student_logits: torch.Tensor,
    teacher_logits: torch.Tensor,
    student_labels: torch.Tensor,
    teacher_labels: torch.Tensor,
    student_ids: torch.Tensor,
    teacher_ids: torch.Tensor,
    student_offsets: torch.Tensor | None = None,
    teacher_offsets: torch.Tensor | None = None,
    *,
    extended: bool = True,
    strategy: str = "observed",
    student_temperature: float = 1.0,
    teacher_temperature: float = 1.0,
    skip_student_eos: bool = True,
    skip_teacher_eos: bool = True,
    shared: tuple[torch.Tensor, torch.Tensor] | None = None,
    beta: float = 0.5,
    matched_weight: float | None = None,
    unmatched_weight: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """(loss, matched part, unmatched part) of ULD on one sequence pair; the parts are hybrid ULD's (with `shared`)
    and None without it or when nothing was compared.

    ULD: logits [T, V], labels/ids [T] (-100 outside the completion), byte offsets [T, 2]
    (needed when `extended`). The completion's last token is left out on a side with skip_*_eos. As in TRL's GOLD,
    the distributions compared under 'observed' are those AT the completion's positions; 'bayesian' reads them one
    position earlier (the ones predicting the completion's tokens). A side without completion tokens gives 0. With
    `shared` token ids the aligned distributions are compared by `hybrid_uld` (beta and the weights are its)."""
    s_start, s_size = _span(student_labels)
    t_start, t_size = _span(teacher_labels)
    s_size -= int(skip_student_eos)
    t_size -= int(skip_teacher_eos)
    zero = student_logits.sum() * 0.0
    if s_size <= 0 or t_size <= 0:
        return zero, None, None
    if extended and (student_offsets is None or teacher_offsets is None):
        raise ConfigError("use_extended_uld=True aligns tokens by byte offsets; pass both sides' offsets.")

    def spans():
        s_off = student_offsets[s_start : s_start + s_size].tolist() if extended else None
        t_off = teacher_offsets[t_start : t_start + t_size].tolist() if extended else None
        return s_off, t_off

    if strategy == "bayesian" and (s_start == 0 or t_start == 0):  # no logit predicts a first token at position 0
        if extended:
            groups = align_by_byte_offsets(*spans())
            if not groups[0]:
                return zero, None, None
            s_drop, t_drop = len(groups[0][0]), len(groups[1][0])
        else:
            s_drop = t_drop = 1
        s_start, s_size, t_start, t_size = s_start + s_drop, s_size - s_drop, t_start + t_drop, t_size - t_drop
        if s_size <= 0 or t_size <= 0:
            return zero, None, None
    shift = 1 if strategy == "bayesian" else 0
    s_probs = (student_logits[s_start - shift : s_start + s_size - shift] / student_temperature).softmax(-1)
    t_probs = (teacher_logits[t_start - shift : t_start + t_size - shift] / teacher_temperature).softmax(-1)
    s_ids = student_ids[s_start : s_start + s_size].tolist()
    t_ids = teacher_ids[t_start : t_start + t_size].tolist()
    if extended:
        pairs = [(sg, tg) for sg, tg in zip(*align_by_byte_offsets(*spans())) if sg and tg]
        s_aligned = merge_groups(s_probs, [sg for sg, _ in pairs], s_ids, strategy)
        t_aligned = merge_groups(t_probs, [tg for _, tg in pairs], t_ids, strategy)
        if not pairs:
            return zero, None, None
    else:
        n = min(len(s_ids), len(t_ids))
        s_aligned, t_aligned = s_probs[:n], t_probs[:n]
    if shared is not None:
        return hybrid_uld(s_aligned, t_aligned, shared, beta, matched_weight, unmatched_weight)
    return sorted_l1(s_aligned, t_aligned), None, None
