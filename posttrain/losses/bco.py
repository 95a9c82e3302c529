"""Binary Classifier Optimization (Jung et al. 2024, arXiv:2404.04656): unpaired thumbs-up / thumbs-down data
trains the policy as a binary classifier whose logit is the implicit reward r = beta * log(pi / pi_ref).

    loss(desirable)   = -log sigma(r - delta)
    loss(undesirable) = -log sigma(-(r - delta))   (times w(x) with UDM)

delta, the reward shift, is the running mean of every implicit reward seen in training so far (this batch
included). Underlying distribution matching (UDM) reweights each undesirable example by the density ratio
w(x) = p(x | desirable) / p(x | undesirable) of its prompt, estimated with a classifier that tells the two
prompt sets apart: w = P(desirable | x) / P(undesirable | x), clamped to [min_density_ratio, max_density_ratio].
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor


def bco_loss(
    policy_logps: Tensor,
    ref_logps: Tensor,
    labels: Tensor,
    delta: Tensor | float,
    *,
    beta: float = 0.1,
    undesirable_weights: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """Per-example losses [B] and implicit rewards [B] (detached). `labels` [B] is True for desirable examples;
    `undesirable_weights` [B] (UDM's density ratios) scale the undesirable examples' losses."""
    rewards = beta * (policy_logps - ref_logps)
    shifted = rewards - delta
    losses = torch.where(labels, -F.logsigmoid(shifted), -F.logsigmoid(-shifted))
    if undesirable_weights is not None:
        losses = torch.where(labels, losses, undesirable_weights.to(losses.dtype) * losses)
    return losses, rewards.detach()


def update_running_mean(mean: float, count: int, values: Tensor) -> tuple[float, int]:
    """The mean of everything seen so far after `values` join (`count` values gave `mean`)."""
    n = values.numel()
    if n == 0:
        return mean, count
    total = count + n
    return mean + (values.double().mean().item() - mean) * n / total, total


def density_ratio_weights(prob_desirable: Tensor, min_ratio: float, max_ratio: float) -> Tensor:
    """P(desirable | x) / P(undesirable | x), clamped: the UDM weight of an undesirable example's loss."""
    return (prob_desirable / (1 - prob_desirable + 1e-8)).clamp(min=min_ratio, max=max_ratio)


def fit_density_ratio_classifier(
    embeddings: Tensor, desirable: Tensor, c: float = 1.0, max_iter: int = 500
) -> tuple[Tensor, Tensor]:
    """L2-regularised logistic regression telling desirable prompts (True) from undesirable ones, classes
    weighted n / (2 n_class) so that both count alike (scikit-learn's LogisticRegression(class_weight='balanced')
    objective, which TRL's BCO used): minimises 0.5 ||w||^2 + c * sum_i s_i log(1 + exp(-y_i (w.x_i + b))).
    Returns (w [D], b []) in float64."""
    x = embeddings.detach().double().cpu()
    y = desirable.detach().cpu().double() * 2 - 1
    n = len(y)
    n_pos = (y > 0).sum().item()
    if n_pos in (0, n):
        raise ValueError("the density-ratio classifier needs prompts of both classes.")
    sample_weight = torch.where(y > 0, n / (2 * n_pos), n / (2 * (n - n_pos))).double()
    w = torch.zeros(x.shape[1], dtype=torch.float64, requires_grad=True)
    b = torch.zeros((), dtype=torch.float64, requires_grad=True)
    optimizer = torch.optim.LBFGS(
        [w, b], lr=1, max_iter=max_iter, tolerance_grad=1e-10, tolerance_change=1e-14, line_search_fn="strong_wolfe"
    )

    def objective():
        optimizer.zero_grad()
        loss = 0.5 * w.dot(w) + c * (sample_weight * F.softplus(-y * (x @ w + b))).sum()
        loss.backward()
        return loss

    optimizer.step(objective)
    return w.detach(), b.detach()


def prob_desirable(embeddings: Tensor, weight: Tensor, bias: Tensor) -> Tensor:
    """The classifier's P(desirable | prompt) for each embedding row."""
    x = embeddings.to(weight.device, torch.float64)
    return torch.sigmoid(x @ weight + bias)
