"""Process reward models (Uesato et al. 2022; Lightman et al. 2023, "Let's Verify Step by Step"): a token
classifier predicts, at the last token of each reasoning step, whether the step is correct.

Training is cross-entropy of the step labels at the labelled positions (IGNORE_INDEX elsewhere). Scoring turns
the classifier's outputs at the step ends into a per-step probability of "correct" and aggregates those into
one reward per completion.
"""

from __future__ import annotations

import math

import torch

from posttrain.errors import ConfigError

IGNORE_INDEX = -100
AGGREGATES = ("min", "prod", "mean", "last")


def step_label_sums(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(summed cross-entropy, correct predictions, labelled positions) over the positions whose label is not
    IGNORE_INDEX. logits [..., C], labels [...] (class ids). Sums, so that the trainer divides by the labelled
    positions of the whole effective batch."""
    mask = labels != IGNORE_INDEX
    dtype = torch.float64 if logits.dtype == torch.float64 else torch.float32
    chosen = logits[mask].to(dtype)
    targets = labels[mask]
    loss = torch.nn.functional.cross_entropy(chosen, targets, reduction="sum")
    none = torch.zeros((), dtype=torch.long, device=labels.device)
    correct = (chosen.argmax(-1) == targets).sum() if len(targets) else none
    return loss, correct, mask.sum()


def step_probabilities(logits: torch.Tensor, positive_label: int = 1) -> torch.Tensor:
    """P(step correct) from a classifier's outputs at step ends: softmax over classes, or the sigmoid of a
    single-output head."""
    logits = logits.float() if logits.dtype != torch.float64 else logits
    if logits.shape[-1] == 1:
        return logits[..., 0].sigmoid()
    return logits.softmax(-1)[..., positive_label]


def aggregate_steps(probabilities: list[float], aggregate: str = "min") -> float:
    """One reward from per-step probabilities: the weakest step ('min', the usual PRM score), their product
    ('prod': the chance that all steps are right), their 'mean', or the 'last' step's. No steps: 0.0."""
    if aggregate not in AGGREGATES:
        raise ConfigError(f"aggregate={aggregate!r} is not one of {AGGREGATES}.")
    if not probabilities:
        return 0.0
    if aggregate == "min":
        return float(min(probabilities))
    if aggregate == "prod":
        return float(math.prod(probabilities))
    if aggregate == "mean":
        return float(sum(probabilities) / len(probabilities))
    return float(probabilities[-1])
