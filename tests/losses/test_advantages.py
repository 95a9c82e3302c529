"""Advantages and KL controllers against hand-worked numbers and plain-Python float64 references."""

import math
import statistics

import pytest
import torch

from posttrain.errors import ConfigError
from posttrain.losses.advantages import (
    AdaptiveEntropyController,
    AdaptiveKLController,
    FixedKLController,
    decoupled_advantages,
    gae,
    group_advantages,
    leave_one_out_advantages,
    whiten,
)

REWARDS = [1.0, 2.0, 3.0, 6.0, 0.0, 0.0, 1.0, 0.5]


def assert_close(actual: torch.Tensor, expected: list) -> None:
    torch.testing.assert_close(actual, torch.tensor(expected, dtype=torch.float64), rtol=1e-10, atol=1e-12)


def reference_group_advantages(rewards: list, k: int, scale: str, eps: float) -> list:
    out = []
    batch_std = statistics.stdev(rewards)
    for start in range(0, len(rewards), k):
        group = rewards[start : start + k]
        mean = sum(group) / k
        std = {"group": statistics.stdev(group), "batch": batch_std, "none": None}[scale]
        out += [(r - mean) / (std + eps) if std is not None else r - mean for r in group]
    return out


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_group_advantages_match_reference(scale):
    actual = group_advantages(torch.tensor(REWARDS, dtype=torch.float64), 4, scale_rewards=scale, eps=1e-4)
    assert_close(actual, reference_group_advantages(REWARDS, 4, scale, 1e-4))


def test_group_advantages_by_hand():
    # Group [1, 2, 3, 6]: mean 3, unbiased std sqrt((4 + 1 + 0 + 9) / 3) = sqrt(14 / 3).
    std = math.sqrt(14 / 3)
    actual = group_advantages(torch.tensor(REWARDS[:4], dtype=torch.float64), 4, eps=0.0)
    assert_close(actual, [-2 / std, -1 / std, 0.0, 3 / std])
    unscaled = group_advantages(torch.tensor(REWARDS[:4], dtype=torch.float64), 4, scale_rewards="none")
    assert_close(unscaled, [-2.0, -1.0, 0.0, 3.0])


def test_group_of_equal_rewards_gives_zero_not_nan():
    actual = group_advantages(torch.tensor([1.0, 1.0, 0.0, 1.0], dtype=torch.float64), 2)
    assert_close(actual, [0.0, 0.0, -0.5 / (math.sqrt(0.5) + 1e-4), 0.5 / (math.sqrt(0.5) + 1e-4)])


def test_leave_one_out_by_hand():
    # Sum 12: baselines (12 - r) / 3 = 11/3, 10/3, 3, 2.
    actual = leave_one_out_advantages(torch.tensor([1.0, 2.0, 3.0, 6.0], dtype=torch.float64), 4)
    assert_close(actual, [1 - 11 / 3, 2 - 10 / 3, 0.0, 4.0])


def test_leave_one_out_matches_reference():
    k = 4
    expected = []
    for i, r in enumerate(REWARDS):
        start = i - i % k
        others = [REWARDS[j] for j in range(start, start + k) if j != i]
        expected.append(r - sum(others) / len(others))
    assert_close(leave_one_out_advantages(torch.tensor(REWARDS, dtype=torch.float64), k), expected)


@pytest.mark.parametrize("fn", [group_advantages, leave_one_out_advantages])
def test_group_shape_errors(fn):
    with pytest.raises(ConfigError, match="num_generations=1"):
        fn(torch.zeros(4), 1)
    with pytest.raises(ConfigError, match="multiple of num_generations"):
        fn(torch.zeros(6), 4)


def test_bad_scale_rewards():
    with pytest.raises(ConfigError, match="scale_rewards='std'"):
        group_advantages(torch.zeros(4), 2, scale_rewards="std")


def reference_gae(rewards, values, mask, gamma, lam, dones=None) -> tuple[list, list]:
    """Per row: walk the valid tokens backwards; an episode ends after its last valid token or a done."""
    advantages, returns = [], []
    for b, row_mask in enumerate(mask):
        adv_row = [0.0] * len(row_mask)
        steps = [t for t, m in enumerate(row_mask) if m]
        next_value = next_adv = 0.0
        for t in reversed(steps):
            if dones is not None and dones[b][t]:
                next_value = next_adv = 0.0
            delta = rewards[b][t] + gamma * next_value - values[b][t]
            adv_row[t] = delta + gamma * lam * next_adv
            next_value, next_adv = values[b][t], adv_row[t]
        advantages.append(adv_row)
        returns.append([a + v if m else 0.0 for a, v, m in zip(adv_row, values[b], row_mask)])
    return advantages, returns


def as_tensor(rows) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.float64)


def test_gae_by_hand():
    # gamma = 0.9, lam = 0.8, so gamma * lam = 0.72. Row 0: rewards [0, 0, 1], values [0.5, 0.4, 0.6].
    #   t=2: delta = 1 - 0.6 = 0.4 (episode ends: nothing bootstrapped)   A2 = 0.4
    #   t=1: delta = 0.9 * 0.6 - 0.4 = 0.14                               A1 = 0.14 + 0.72 * 0.4 = 0.428
    #   t=0: delta = 0.9 * 0.4 - 0.5 = -0.14                              A0 = -0.14 + 0.72 * 0.428 = 0.16816
    # Row 1: same values, rewards [0, 1, 5], mask cuts the third token (its reward 5 is ignored).
    #   t=1: delta = 1 - 0.4 = 0.6                                        A1 = 0.6
    #   t=0: delta = -0.14                                                A0 = -0.14 + 0.72 * 0.6 = 0.292
    rewards = as_tensor([[0, 0, 1], [0, 1, 5]])
    values = as_tensor([[0.5, 0.4, 0.6], [0.5, 0.4, 0.6]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    advantages, returns = gae(rewards, values, mask, gamma=0.9, lam=0.8)
    assert_close(advantages, [[0.16816, 0.428, 0.4], [0.292, 0.6, 0.0]])
    assert_close(returns, [[0.66816, 0.828, 1.0], [0.792, 1.0, 0.0]])


def test_gae_termination_mid_sequence_by_hand():
    # Row 0 of the test above with the episode ending after token 1 (gamma 0.9, lam 0.8):
    #   t=2: A2 = 0.4 (a new episode, unchanged)
    #   t=1: delta = 0 - 0.4 = -0.4 (no bootstrap from token 2)            A1 = -0.4
    #   t=0: delta = -0.14                                                A0 = -0.14 + 0.72 * -0.4 = -0.428
    rewards = as_tensor([[0, 0, 1]])
    values = as_tensor([[0.5, 0.4, 0.6]])
    dones = torch.tensor([[False, True, False]])
    advantages, returns = gae(rewards, values, torch.ones(1, 3), gamma=0.9, lam=0.8, dones=dones)
    assert_close(advantages, [[-0.428, -0.4, 0.4]])
    assert_close(returns, [[0.072, 0.0, 1.0]])


def test_gae_matches_reference_with_padding_and_dones():
    generator = torch.Generator().manual_seed(0)
    rewards = torch.randn(3, 6, generator=generator, dtype=torch.float64)
    values = torch.randn(3, 6, generator=generator, dtype=torch.float64)
    mask = [[1, 1, 1, 1, 1, 1], [1, 1, 1, 0, 0, 0], [0, 1, 1, 1, 1, 0]]  # full, right-, both-side padded
    dones = [[False, False, True, False, False, False], [False] * 6, [False, False, True, False, True, False]]
    advantages, returns = gae(rewards, values, torch.tensor(mask), 0.95, 0.9, dones=torch.tensor(dones))
    expected_adv, expected_ret = reference_gae(rewards.tolist(), values.tolist(), mask, 0.95, 0.9, dones)
    assert_close(advantages, expected_adv)
    assert_close(returns, expected_ret)


def test_gae_detaches():
    values = torch.ones(1, 2, dtype=torch.float64, requires_grad=True)
    advantages, returns = gae(torch.ones(1, 2, dtype=torch.float64), values, torch.ones(1, 2), 1.0, 1.0)
    assert not advantages.requires_grad and not returns.requires_grad


def test_whiten_masked():
    values = as_tensor([[1.0, 2.0, 100.0], [4.0, 8.0, -50.0]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 0]])
    valid = [1.0, 2.0, 4.0, 8.0]
    mean, var = statistics.mean(valid), statistics.variance(valid)  # variance: unbiased
    scale = 1 / math.sqrt(var + 1e-8)
    expected = [[(1 - mean) * scale, (2 - mean) * scale, 0.0], [(4 - mean) * scale, (8 - mean) * scale, 0.0]]
    assert_close(whiten(values, mask), expected)
    kept_mean = [[x + mean if m else 0.0 for x, m in zip(row, ms)] for row, ms in zip(expected, mask.tolist())]
    assert_close(whiten(values, mask, shift_mean=False), kept_mean)


def test_whiten_without_mask():
    values = [3.0, -1.0, 2.0, 0.5]
    mean, std = statistics.mean(values), statistics.stdev(values)
    assert_close(whiten(as_tensor(values), eps=0.0), [(v - mean) / std for v in values])


def test_whiten_needs_two_entries():
    with pytest.raises(ConfigError, match="at least 2 valid entries"):
        whiten(as_tensor([1.0, 2.0]), torch.tensor([1, 0]))


def test_adaptive_kl_overshoot_and_undershoot():
    # target 6, horizon 10000, 256 steps. KL 12: error 1 clipped to 0.2, mult 1 + 0.2 * 256 / 10000 = 1.00512.
    controller = AdaptiveKLController(0.2, target=6.0, horizon=10000)
    controller.update(12.0, n_steps=256)
    assert controller.value == pytest.approx(0.2 * 1.00512, rel=1e-12)
    # KL 3: error -0.5 clipped to -0.2, mult 0.99488.
    controller = AdaptiveKLController(0.2, target=6.0, horizon=10000)
    controller.update(torch.tensor(3.0), n_steps=256)
    assert controller.value == pytest.approx(0.2 * 0.99488, rel=1e-12)
    # KL 6.6: error 0.1 (inside the clip), mult 1 + 0.1 * 256 / 10000 = 1.00256; updates compound.
    controller.update(6.6, n_steps=256)
    assert controller.value == pytest.approx(0.2 * 0.99488 * 1.00256, rel=1e-12)


def test_adaptive_kl_rejects_bad_settings():
    with pytest.raises(ConfigError, match="target=0"):
        AdaptiveKLController(0.2, target=0, horizon=10000)


def test_fixed_kl_does_not_move():
    controller = FixedKLController(0.05)
    controller.update(100.0, n_steps=256)
    assert controller.value == 0.05


# -- GDPO: normalise each reward function, then sum ------------------------------------------------------------
def _mean_std(values):
    values = [v for v in values if not math.isnan(v)]
    mean = sum(values) / len(values) if values else math.nan
    std = math.sqrt(sum((v - mean) ** 2 for v in values) / (len(values) - 1)) if len(values) > 1 else math.nan
    return mean, std


def reference_decoupled(per_function, weights, k, eps=1e-4):
    n, f = len(per_function), len(weights)
    normalised = [[math.nan] * f for _ in range(n)]
    for start in range(0, n, k):
        for j in range(f):
            mean, std = _mean_std([per_function[i][j] for i in range(start, start + k)])
            for i in range(start, start + k):
                normalised[i][j] = (per_function[i][j] - mean) / (std + eps)
    summed = []
    for i in range(n):
        if all(math.isnan(v) for v in per_function[i]):
            summed.append(math.nan)
        else:
            summed.append(sum(w * v for w, v in zip(weights, normalised[i]) if not math.isnan(v)))
    mean, std = _mean_std(summed)
    return [0.0 if math.isnan(s) else (s - mean) / (std + eps) for s in summed]


def test_decoupled_advantages_match_reference():
    nan = math.nan
    # Function 0 spreads over [0, 100], function 1 over [0, 1]: summing first would ignore function 1.
    per_function = [
        [10.0, 1.0],
        [90.0, 0.0],
        [50.0, 1.0],
        [0.0, nan],
        [100.0, 0.0],
        [100.0, 1.0],
        [nan, nan],
        [20.0, 0.5],
    ]
    weights = [1.0, 2.0]
    actual = decoupled_advantages(
        torch.tensor(per_function, dtype=torch.float64), torch.tensor(weights, dtype=torch.float64), 4
    )
    assert_close(actual, reference_decoupled(per_function, weights, 4))
    assert actual[6] == 0.0  # no function applies


def test_decoupled_differs_from_summing_first():
    per_function = torch.tensor([[0.0, 1.0], [100.0, 0.0], [0.0, 0.0], [100.0, 1.0]], dtype=torch.float64)
    decoupled = decoupled_advantages(per_function, torch.ones(2, dtype=torch.float64), 4)
    summed_first = group_advantages(per_function.sum(1), 4)
    # Summing first, function 1 barely moves the order of rows 0 and 2; normalising first it counts as much.
    assert decoupled[0] - decoupled[2] > 0.9 and summed_first[0] - summed_first[2] < 0.05


def test_adaptive_entropy_controller():
    controller = AdaptiveEntropyController(coef=0.01, target=1.0, delta=0.004, coef_min=0.0, coef_max=0.015)
    assert controller.applied_coef() == 0.0  # nothing measured yet
    controller.update(0.5)  # below target: raise
    assert controller.coef == pytest.approx(0.014) and controller.applied_coef() == pytest.approx(0.014)
    controller.update(0.9)
    assert controller.coef == pytest.approx(0.015)  # capped at coef_max
    controller.update(2.0)  # above target: lower, and the bonus is off
    assert controller.coef == pytest.approx(0.011) and controller.applied_coef() == 0.0
    for _ in range(5):
        controller.update(3.0)
    assert controller.coef == 0.0  # floored at coef_min
    restored = AdaptiveEntropyController(coef=0.5, target=1.0, delta=0.004, coef_min=0.0, coef_max=0.015)
    restored.load_state(controller.state())
    assert (restored.coef, restored.last_entropy) == (0.0, 3.0)
    with pytest.raises(ConfigError, match="entropy_coef_min"):
        AdaptiveEntropyController(0.0, 1.0, 0.1, coef_min=1.0, coef_max=0.5)
