"""The one NaN-skipping standard deviation and the one masked mean (losses/reductions.py). nanstd, used by the
advantages, the online metrics and TRL's `trl.trainer.utils.nanstd` face: NaN where fewer than two values remain, as
torch.std of one value. masked_mean: 0 over an empty mask."""

import math

import pytest
import torch

from posttrain.losses.advantages import decoupled_advantages
from posttrain.losses.reductions import masked_mean, nanstd

NAN = float("nan")


def _reference(values: list[float]) -> float:
    present = [v for v in values if not math.isnan(v)]
    if len(present) < 2:
        return NAN
    mean = sum(present) / len(present)
    return math.sqrt(sum((v - mean) ** 2 for v in present) / (len(present) - 1))


@pytest.mark.parametrize(
    "values",
    [[1.0, 2.0, 4.0], [1.0, NAN, 4.0, 7.0], [3.0], [NAN, 5.0], [NAN, NAN], [], [2.0, 2.0]],
)
def test_nanstd_of_a_vector_matches_a_float64_reference(values):
    got = nanstd(torch.tensor(values, dtype=torch.float64))
    want = _reference(values)
    assert math.isnan(want) == bool(torch.isnan(got)), (values, got)
    if not math.isnan(want):
        assert float(got) == pytest.approx(want, rel=1e-12)


def test_nanstd_along_a_dimension_row_by_row():
    rows = [[1.0, 5.0, NAN], [NAN, NAN, 2.0], [0.5, -1.0, 3.5]]
    got = nanstd(torch.tensor(rows, dtype=torch.float64), dim=1)
    kept = nanstd(torch.tensor(rows, dtype=torch.float64), dim=1, keepdim=True)
    assert kept.shape == (3, 1)
    for i, row in enumerate(rows):
        want = _reference(row)
        assert math.isnan(want) == bool(torch.isnan(got[i]))
        if not math.isnan(want):
            assert float(got[i]) == pytest.approx(want, rel=1e-12) and float(kept[i, 0]) == float(got[i])


def test_decoupled_advantages_use_the_same_nanstd():
    """GDPO normalises each function within its group with nanstd: a group with one scored completion of a function
    gives NaN std there, which must not leak into the summed advantages of completions that function never scored."""
    rewards = torch.tensor([[1.0, 0.0], [0.0, NAN], [2.0, 1.0], [1.0, 3.0]], dtype=torch.float64)
    weights = torch.ones(2, dtype=torch.float64)
    got = decoupled_advantages(rewards, weights, num_generations=2)
    grouped = rewards.view(2, 2, 2)
    normalised = (grouped - torch.nanmean(grouped, 1, keepdim=True)) / (nanstd(grouped, 1, True) + 1e-4)
    summed = torch.nansum(normalised * weights, dim=-1).view(-1)
    want = (summed - summed.mean()) / (summed.std() + 1e-4)
    assert torch.allclose(got, want, equal_nan=True)


def test_masked_mean_over_all_positions_a_dimension_and_an_empty_mask():
    values = torch.tensor([[1.0, 2.0, 4.0], [8.0, 16.0, 32.0]])
    mask = torch.tensor([[1, 0, 1], [0, 0, 0]])
    assert masked_mean(values, mask).item() == (1.0 + 4.0) / 2
    assert masked_mean(values, mask.bool()).item() == 2.5
    assert masked_mean(values, mask, dim=-1).tolist() == [2.5, 0.0]  # the empty row is 0, not NaN
    assert masked_mean(values, torch.zeros_like(mask)).item() == 0.0
    # fractional weights: a weighted mean, the weight total clamped to at least 1
    assert masked_mean(values[0], torch.tensor([0.5, 0.5, 1.0])).item() == (0.5 + 1.0 + 4.0) / 2
    assert masked_mean(values[0], torch.tensor([0.25, 0.0, 0.25])).item() == 0.25 + 1.0


def test_masked_mean_keeps_the_gradient_of_the_kept_positions_only():
    values = torch.tensor([3.0, 5.0, 7.0], requires_grad=True)
    masked_mean(values, torch.tensor([1.0, 1.0, 0.0])).backward()
    assert values.grad.tolist() == [0.5, 0.5, 0.0]
