"""Distillation divergences against float64 references written with plain Python math, element by element."""

import math

import pytest
import torch

from posttrain.errors import ConfigError
from posttrain.losses.distillation import (
    check_vocab_sizes,
    forward_kl,
    generalized_jsd,
    reverse_kl,
    shared_vocab,
)

# [2 rows, 3 positions, 5 vocabulary entries], hand-made so that some distributions are peaked, some flat.
STUDENT = torch.tensor(
    [
        [[2.0, 0.5, -1.0, 0.0, 0.3], [0.0, 0.0, 0.0, 0.0, 0.0], [-3.0, 4.0, 1.0, 0.5, -0.5]],
        [[1.0, -1.0, 2.5, 0.0, 0.0], [0.2, 0.1, -0.3, 3.0, 1.0], [5.0, -2.0, 0.0, 1.5, 0.7]],
    ],
    dtype=torch.float64,
)
TEACHER = torch.tensor(
    [
        [[0.0, 1.5, -0.5, 2.0, 0.1], [3.0, -1.0, 0.5, 0.0, 1.0], [-1.0, 2.0, 2.5, -0.5, 0.0]],
        [[1.2, -0.8, 2.0, 0.3, -0.1], [-2.0, 0.0, 1.0, 1.0, 4.0], [0.0, 0.0, 0.0, 0.0, 0.0]],
    ],
    dtype=torch.float64,
)
MASK = torch.tensor([[True, True, False], [True, False, True]])


def _softmax(logits, temperature):
    exps = [math.exp(x / temperature) for x in logits]
    return [e / sum(exps) for e in exps]


def _kl(p, q):
    return sum(pi * math.log(pi / qi) for pi, qi in zip(p, q) if pi > 0)


def _jsd(p_teacher, p_student, beta):
    m = [beta * t + (1 - beta) * s for t, s in zip(p_teacher, p_student)]
    return beta * _kl(p_teacher, m) + (1 - beta) * _kl(p_student, m)


def _reference(divergence, temperature, mask=MASK):
    """divergence(p_teacher, p_student) at every masked-in position, 0 elsewhere."""
    out = torch.zeros(mask.shape, dtype=torch.float64)
    for b in range(mask.shape[0]):
        for t in range(mask.shape[1]):
            if mask[b, t]:
                out[b, t] = divergence(
                    _softmax(TEACHER[b, t].tolist(), temperature), _softmax(STUDENT[b, t].tolist(), temperature)
                )
    return out


@pytest.mark.parametrize("temperature", [1.0, 2.0, 0.5])
def test_kls_match_reference(temperature):
    torch.testing.assert_close(
        forward_kl(STUDENT, TEACHER, MASK, temperature), _reference(_kl, temperature), rtol=1e-12, atol=1e-12
    )
    torch.testing.assert_close(
        reverse_kl(STUDENT, TEACHER, MASK, temperature),
        _reference(lambda t, s: _kl(s, t), temperature),
        rtol=1e-12,
        atol=1e-12,
    )


@pytest.mark.parametrize("beta", [0.1, 0.5, 0.9])
@pytest.mark.parametrize("temperature", [1.0, 2.0])
def test_generalized_jsd_matches_reference(beta, temperature):
    torch.testing.assert_close(
        generalized_jsd(STUDENT, TEACHER, beta, MASK, temperature),
        _reference(lambda t, s: _jsd(t, s, beta), temperature),
        rtol=1e-12,
        atol=1e-12,
    )


def test_two_token_values_by_hand():
    # teacher (1/2, 1/2), student (3/4, 1/4)
    student, teacher = torch.tensor([[math.log(3.0), 0.0]]), torch.tensor([[0.0, 0.0]])
    assert forward_kl(student, teacher).item() == pytest.approx(0.5 * math.log(4 / 3), rel=1e-6)
    assert reverse_kl(student, teacher).item() == pytest.approx(0.75 * math.log(1.5) + 0.25 * math.log(0.5), rel=1e-6)
    # beta = 1/2: m = (5/8, 3/8)
    expected = 0.5 * (0.5 * math.log(0.5 / 0.625) + 0.5 * math.log(0.5 / 0.375)) + 0.5 * (
        0.75 * math.log(0.75 / 0.625) + 0.25 * math.log(0.25 / 0.375)
    )
    assert generalized_jsd(student, teacher, 0.5).item() == pytest.approx(expected, rel=1e-6)


def test_beta_ends_are_the_kls_and_the_limits_of_the_scaled_jsd():
    forward, reverse = forward_kl(STUDENT, TEACHER, MASK), reverse_kl(STUDENT, TEACHER, MASK)
    torch.testing.assert_close(generalized_jsd(STUDENT, TEACHER, 0.0, MASK), forward, rtol=0, atol=0)
    torch.testing.assert_close(generalized_jsd(STUDENT, TEACHER, 1.0, MASK), reverse, rtol=0, atol=0)
    eps = 1e-6
    torch.testing.assert_close(generalized_jsd(STUDENT, TEACHER, eps, MASK) / eps, forward, rtol=1e-4, atol=1e-9)
    torch.testing.assert_close(generalized_jsd(STUDENT, TEACHER, 1 - eps, MASK) / eps, reverse, rtol=1e-4, atol=1e-9)
    # and the interior is neither: the JSD(0.5) is bounded by log 2 while these KLs exceed it somewhere
    assert (forward > math.log(2)).any() and (generalized_jsd(STUDENT, TEACHER, 0.5, MASK) <= math.log(2)).all()


def test_forward_kl_gradient_is_student_minus_teacher_probabilities_over_temperature():
    student = STUDENT.clone().requires_grad_(True)
    temperature = 2.0
    forward_kl(student, TEACHER, MASK, temperature).sum().backward()
    expected = ((STUDENT / temperature).softmax(-1) - (TEACHER / temperature).softmax(-1)) / temperature
    expected = expected * MASK[..., None]
    torch.testing.assert_close(student.grad, expected, rtol=1e-10, atol=1e-12)


def test_masked_positions_are_zero_and_never_computed():
    student = STUDENT.clone()
    student[0, 2] = float("nan")  # a masked-out position
    for values in (forward_kl(student, TEACHER, MASK), generalized_jsd(student, TEACHER, 0.3, MASK)):
        assert not values.isnan().any()
        assert (values[~MASK] == 0).all() and (values[MASK] > 0).all()


def test_zero_probability_teacher_tokens_count_zero():
    teacher = TEACHER[0, :1].clone()
    teacher[..., 4] = float("-inf")
    expected = _kl(_softmax(teacher[0, :4].tolist(), 1.0), _softmax(STUDENT[0, 0].tolist(), 1.0)[:4])
    assert forward_kl(STUDENT[0, :1], teacher).item() == pytest.approx(expected, rel=1e-12)


def test_low_precision_inputs_are_computed_in_float32():
    values = generalized_jsd(STUDENT.bfloat16(), TEACHER.bfloat16(), 0.5, MASK)
    assert values.dtype == torch.float32
    reference = generalized_jsd(STUDENT.bfloat16().double(), TEACHER.bfloat16().double(), 0.5, MASK)
    torch.testing.assert_close(values.double(), reference, rtol=1e-5, atol=1e-7)


def test_shared_vocab_cuts_a_padded_teacher_to_the_student_ids():
    padded = torch.cat([TEACHER, torch.full((2, 3, 3), 7.0, dtype=torch.float64)], -1)
    torch.testing.assert_close(shared_vocab(STUDENT, padded), TEACHER, rtol=0, atol=0)
    with pytest.raises(
        ConfigError,
        match=r"teacher's vocabulary size \(4 logits\) is smaller than the student's "
        r"\(5 logits\)",
    ):
        shared_vocab(STUDENT, TEACHER[..., :4])
    check_vocab_sizes(5, 5)


def test_bad_settings_raise():
    with pytest.raises(ConfigError, match="beta=1.5 must lie in"):
        generalized_jsd(STUDENT, TEACHER, 1.5)
    with pytest.raises(ConfigError, match="temperature=0 must be > 0"):
        forward_kl(STUDENT, TEACHER, temperature=0)
    with pytest.raises(ConfigError, match="differ in shape"):
        reverse_kl(STUDENT, TEACHER[..., :4])
