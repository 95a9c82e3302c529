"""Policy/value losses against hand-worked numbers and plain-Python float64 references."""

import math

import pytest
import torch

from posttrain.errors import ConfigError
from posttrain.losses.policy import (
    aggregate_loss,
    clipped_policy_loss,
    clipped_value_loss,
    entropy_from_logits,
    kl_k3,
    truncated_importance_weights,
)


def as_tensor(rows, requires_grad: bool = False) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.float64, requires_grad=requires_grad)


def assert_close(actual: torch.Tensor, expected) -> None:
    torch.testing.assert_close(actual, as_tensor(expected), rtol=1e-10, atol=1e-12)


def test_kl_k3_known_values():
    # d = ref - logp: 0 -> 0;  -ln 2 -> 0.5 + ln 2 - 1;  1 -> e - 2.
    logps = as_tensor([0.0, math.log(0.5), 0.0])
    ref_logps = as_tensor([0.0, math.log(0.25), 1.0])
    assert_close(kl_k3(logps, ref_logps), [0.0, math.log(2) - 0.5, math.e - 2])


def reference_policy_loss(logps, old, adv, mask, eps_low, eps_high, level, ref=None, beta=0.0):
    """Loops over rows and tokens; `adv` is a list per row (one number) or per token."""
    losses, kls = [], []
    for b, row_mask in enumerate(mask):
        valid = [t for t, m in enumerate(row_mask) if m]
        sequence_log_ratio = sum(logps[b][t] - old[b][t] for t in valid) / len(valid)
        row = []
        for t, m in enumerate(row_mask):
            if not m:
                row.append(0.0)
                continue
            log_ratio = sequence_log_ratio if level == "sequence" else logps[b][t] - old[b][t]
            ratio = math.exp(log_ratio)
            clipped = min(max(ratio, 1 - eps_low), 1 + eps_high)
            a = adv[b] if not isinstance(adv[b], list) else adv[b][t]
            loss = -min(ratio * a, clipped * a)
            if ref is not None:
                d = ref[b][t] - logps[b][t]
                kls.append(math.exp(d) - d - 1)
                loss += beta * kls[-1]
            row.append(loss)
        losses.append(row)
    return losses, (sum(kls) / len(kls) if kls else None)


def test_clip_cases_by_hand():
    # eps 0.2, old logps 0, so ratio = exp(logps). Per token (ratio, A) -> loss, clipped?
    #   (1.1, +1) inside                  -> -1.1
    #   (1.5, +1) above, A > 0            -> -min(1.5, 1.2) = -1.2   high-clipped, no gradient
    #   (1.5, -1) above, A < 0            -> -min(-1.5, -1.2) = 1.5  (the clip does not bind)
    #   (0.5, +1) below, A > 0            -> -min(0.5, 0.8) = -0.5   (the clip does not bind)
    #   (0.5, -1) below, A < 0            -> -min(-0.5, -0.8) = 0.8  low-clipped, no gradient
    #   (0.9, -1) inside                  -> 0.9
    # plus one padding token holding -inf, which must not reach the loss or the gradient.
    ratios = [1.1, 1.5, 1.5, 0.5, 0.5, 0.9]
    logps = as_tensor([[math.log(r) for r in ratios] + [-math.inf]], requires_grad=True)
    advantages = as_tensor([[1.0, 1.0, -1.0, 1.0, -1.0, -1.0, 7.0]])
    mask = torch.tensor([[1, 1, 1, 1, 1, 1, 0]])
    loss, stats = clipped_policy_loss(logps, torch.zeros_like(logps), advantages, mask)
    assert_close(loss, [[-1.1, -1.2, 1.5, -0.5, 0.8, 0.9, 0.0]])
    assert_close(stats["clip_ratio_high"], 1 / 6)
    assert_close(stats["clip_ratio_low"], 1 / 6)
    assert_close(stats["clip_ratio"], 2 / 6)
    assert "kl" not in stats
    loss.sum().backward()
    # d(-r A)/d logp = -A r where the unclipped term is the minimum; 0 where the clip binds.
    assert_close(logps.grad, [[-1.1, 0.0, 1.5, -0.5, 0.0, 0.9, 0.0]])


def test_asymmetric_epsilon():
    # eps_low 0.2, eps_high 0.28: (1.25, +1) is inside (a symmetric 0.2 would clip it), (1.3, +1) clips to
    # 1.28, (0.75, -1) clips to 0.8, (0.85, -1) is inside.
    ratios = [1.25, 1.3, 0.75, 0.85]
    logps = as_tensor([[math.log(r) for r in ratios]])
    advantages = as_tensor([[1.0, 1.0, -1.0, -1.0]])
    loss, stats = clipped_policy_loss(
        logps, torch.zeros_like(logps), advantages, torch.ones(1, 4), epsilon_low=0.2, epsilon_high=0.28
    )
    assert_close(loss, [[-1.25, -1.28, 0.8, 0.85]])
    assert_close(stats["clip_ratio_high"], 0.25)
    assert_close(stats["clip_ratio_low"], 0.25)


def test_sequence_level_ratio_by_hand():
    # Row 0 log ratios [0.1, 0.2, 0.3]: mean 0.2, ratio e^0.2 = 1.2214 > 1.2 with A = +1 -> every token -1.2,
    # clipped. Row 1 log ratios [-0.1, 0.3] (third token padding): mean 0.1, ratio e^0.1 with A = -1 ->
    # every valid token +e^0.1, unclipped; the gradient of the row's loss sum w.r.t. each of its logps is
    # 2 tokens * (-A) * ratio * (1/2 from the mean) = e^0.1.
    logps = as_tensor([[0.1, 0.2, 0.3], [-0.1, 0.3, 5.0]], requires_grad=True)
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    loss, stats = clipped_policy_loss(
        logps, torch.zeros(2, 3, dtype=torch.float64), as_tensor([1.0, -1.0]), mask,
        importance_sampling_level="sequence",
    )
    ratio = math.exp(0.1)
    assert_close(loss, [[-1.2, -1.2, -1.2], [ratio, ratio, 0.0]])
    assert_close(stats["clip_ratio_high"], 3 / 5)
    assert_close(stats["clip_ratio_low"], 0.0)
    loss.sum().backward()
    assert_close(logps.grad, [[0.0, 0.0, 0.0], [ratio, ratio, 0.0]])


@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("per_token_advantages", [False, True])
def test_policy_loss_matches_reference(level, per_token_advantages):
    generator = torch.Generator().manual_seed(1)
    logps = -torch.rand(3, 5, generator=generator, dtype=torch.float64) * 2
    old_logps = logps + 0.3 * torch.randn(3, 5, generator=generator, dtype=torch.float64)
    ref_logps = logps + 0.5 * torch.randn(3, 5, generator=generator, dtype=torch.float64)
    shape = (3, 5) if per_token_advantages else (3,)
    advantages = torch.randn(*shape, generator=generator, dtype=torch.float64)
    mask = [[1, 1, 1, 1, 1], [1, 1, 0, 0, 0], [1, 1, 1, 1, 0]]
    loss, stats = clipped_policy_loss(
        logps, old_logps, advantages, torch.tensor(mask), epsilon_low=0.1, epsilon_high=0.15,
        importance_sampling_level=level, ref_logps=ref_logps, beta=0.05,
    )
    expected, expected_kl = reference_policy_loss(
        logps.tolist(), old_logps.tolist(), advantages.tolist(), mask, 0.1, 0.15, level, ref_logps.tolist(), 0.05
    )
    assert_close(loss, expected)
    assert_close(stats["kl"], expected_kl)


def test_kl_logged_but_not_added_when_beta_is_zero():
    logps = as_tensor([[math.log(1.1), 0.0]])
    ref_logps = as_tensor([[0.0, 1.0]])
    old_logps = torch.zeros(1, 2, dtype=torch.float64)
    loss, stats = clipped_policy_loss(logps, old_logps, as_tensor([1.0]), torch.ones(1, 2), ref_logps=ref_logps)
    assert_close(loss, [[-1.1, -1.0]])
    assert_close(stats["kl"], ((1 / 1.1 + math.log(1.1) - 1) + (math.e - 2)) / 2)


def test_policy_loss_rejects_bad_settings():
    x = torch.zeros(1, 2)
    with pytest.raises(ConfigError, match="no ref_logps"):
        clipped_policy_loss(x, x, torch.zeros(1), x, beta=0.1)
    with pytest.raises(ConfigError, match="importance_sampling_level='seq'"):
        clipped_policy_loss(x, x, torch.zeros(1), x, importance_sampling_level="seq")
    with pytest.raises(ConfigError, match="epsilon_low=1.5"):
        clipped_policy_loss(x, x, torch.zeros(1), x, epsilon_low=1.5)


# Padding holds 100 so that a padding leak shows up in the result.
LOSS = [[1.0, 2.0, 3.0], [4.0, 100.0, 100.0]]
MASK = [[1, 1, 1], [1, 0, 0]]


def test_aggregate_loss_types_by_hand():
    loss, mask = as_tensor(LOSS), torch.tensor(MASK)
    assert_close(aggregate_loss(loss, mask, "grpo"), (2.0 + 4.0) / 2)  # sequence means 2 and 4
    assert_close(aggregate_loss(loss, mask, "bnpo"), 10.0 / 4)  # 4 valid tokens
    assert_close(aggregate_loss(loss, mask, "dr_grpo", max_completion_length=3), 10.0 / (2 * 3))
    assert_close(aggregate_loss(loss, mask, "dapo", total_tokens=8), 10.0 / 8)  # global count from the caller


def reference_aggregate(loss, mask, loss_type, total_sequences, total_tokens, max_len):
    sums = [sum(l for l, m in zip(row, ms) if m) for row, ms in zip(loss, mask)]
    if loss_type == "grpo":
        return sum(s / sum(ms) for s, ms in zip(sums, mask)) / total_sequences
    if loss_type == "dr_grpo":
        return sum(sums) / (total_sequences * max_len)
    return sum(sums) / total_tokens


def random_batch(seed: int):
    generator = torch.Generator().manual_seed(seed)
    loss = torch.randn(4, 6, generator=generator, dtype=torch.float64)
    mask = torch.tensor([[1] * 6, [1, 1, 0, 0, 0, 0], [1, 1, 1, 1, 1, 0], [1, 0, 0, 0, 0, 0]])
    return loss, mask


@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dr_grpo", "dapo"])
def test_aggregate_loss_matches_reference(loss_type):
    loss, mask = random_batch(2)
    actual = aggregate_loss(loss, mask, loss_type, total_sequences=10, total_tokens=40, max_completion_length=6)
    expected = reference_aggregate(loss.tolist(), mask.tolist(), loss_type, 10, 40, 6)
    assert_close(actual, expected)


@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dr_grpo", "dapo"])
def test_split_invariance_of_values_and_gradients(loss_type):
    """Two micro-batches with the global counts give the full batch's loss and gradient."""
    per_token, mask = random_batch(3)
    per_token.requires_grad_(True)
    totals = dict(total_sequences=4, total_tokens=mask.sum(), max_completion_length=6)
    full = aggregate_loss(per_token, mask, loss_type, **totals)
    (full_grad,) = torch.autograd.grad(full, per_token)
    parts = [aggregate_loss(per_token[rows], mask[rows], loss_type, **totals) for rows in (slice(0, 1), slice(1, 4))]
    (split_grad,) = torch.autograd.grad(sum(parts), per_token)
    torch.testing.assert_close(sum(parts), full, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(split_grad, full_grad, rtol=1e-12, atol=1e-12)


def test_bnpo_with_local_counts_is_not_split_invariant():
    # Documented behaviour: without total_tokens each micro-batch is normalised by its own token count.
    loss, mask = random_batch(4)
    local = [aggregate_loss(loss[rows], mask[rows], "bnpo") for rows in (slice(0, 1), slice(1, 4))]
    first = loss[0].sum() / 6
    rest = (loss[1:] * mask[1:]).sum() / (2 + 5 + 1)
    assert_close(local[0] + local[1], (first + rest).item())


def test_aggregate_loss_rejects_missing_normalisers():
    loss, mask = as_tensor(LOSS), torch.tensor(MASK)
    with pytest.raises(ConfigError, match="pass total_tokens"):
        aggregate_loss(loss, mask, "dapo")
    with pytest.raises(ConfigError, match="max_completion_length"):
        aggregate_loss(loss, mask, "dr_grpo")
    with pytest.raises(ConfigError, match="loss_type='sum'"):
        aggregate_loss(loss, mask, "sum")


def test_clipped_value_loss_by_hand():
    # cliprange 0.2 around old value 1.0, so the clipped value lies in [0.8, 1.2]:
    #   v 1.1, R 2: inside, 0.5 * 0.9^2 = 0.405, gradient v - R = -0.9
    #   v 1.5, R 2: clip 1.2, max(0.5^2, 0.8^2) = 0.64 -> 0.32, clipped term wins, gradient 0
    #   v 0.5, R 2: clip 0.8, max(1.5^2, 1.2^2) = 2.25 -> 1.125, unclipped wins, gradient -1.5
    #   padding: 0
    values = as_tensor([[1.1, 1.5, 0.5, 9.0]], requires_grad=True)
    old_values = as_tensor([[1.0, 1.0, 1.0, 0.0]])
    returns = as_tensor([[2.0, 2.0, 2.0, -9.0]])
    loss = clipped_value_loss(values, old_values, returns, torch.tensor([[1, 1, 1, 0]]), cliprange_value=0.2)
    assert_close(loss, [[0.405, 0.32, 1.125, 0.0]])
    loss.sum().backward()
    assert_close(values.grad, [[-0.9, 0.0, -1.5, 0.0]])


def test_entropy_matches_reference_and_is_stable():
    generator = torch.Generator().manual_seed(5)
    logits = 3 * torch.randn(2, 3, 7, generator=generator, dtype=torch.float64)
    expected = []
    for row in logits.tolist():
        expected.append([])
        for token_logits in row:
            total = sum(math.exp(x) for x in token_logits)
            expected[-1].append(-sum(math.exp(x) / total * (x - math.log(total)) for x in token_logits))
    assert_close(entropy_from_logits(logits), expected)
    assert_close(entropy_from_logits(logits + 1000.0), expected)  # a naive exp would overflow
    assert_close(entropy_from_logits(torch.zeros(5, dtype=torch.float64)), math.log(5))


def test_entropy_with_banned_tokens_has_finite_gradient():
    logits = as_tensor([0.0, 0.0, -math.inf], requires_grad=True)
    entropy = entropy_from_logits(logits)
    assert_close(entropy, math.log(2))
    entropy.backward()
    assert torch.isfinite(logits.grad).all()


def test_truncated_importance_weights():
    trainer_logps = as_tensor([0.0, 0.0, 0.0], requires_grad=True)
    sampler_logps = as_tensor([math.log(2), -math.log(3), 0.0])
    weights = truncated_importance_weights(trainer_logps, sampler_logps, cap=2.0)
    assert_close(weights, [0.5, 2.0, 1.0])  # exp(ln 3) = 3 is capped at 2
    assert not weights.requires_grad
    with pytest.raises(ConfigError, match="cap=0"):
        truncated_importance_weights(trainer_logps, sampler_logps, cap=0)
