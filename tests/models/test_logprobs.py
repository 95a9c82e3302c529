import math

import pytest
import torch

from posttrain.losses import logprobs
from posttrain.losses.logprobs import linear_logps, next_token_logps, selective_log_softmax


def test_selective_log_softmax_matches_float64_reference():
    logits = torch.tensor([[[1.0, 2.0, 3.0], [0.5, -1.0, 0.0]]])
    ids = torch.tensor([[2, 0]])
    got = selective_log_softmax(logits, ids)
    ref = [
        3.0 - math.log(math.exp(1) + math.exp(2) + math.exp(3)),
        0.5 - math.log(math.exp(0.5) + math.exp(-1.0) + math.exp(0.0)),
    ]
    torch.testing.assert_close(got, torch.tensor([ref], dtype=torch.float32))


def test_next_token_logps_alignment():
    logits = torch.randn(1, 3, 5, dtype=torch.float64)
    ids = torch.tensor([[4, 1, 3]])
    got = next_token_logps(logits, ids)
    lsm = torch.log_softmax(logits, -1)
    assert got[0, 0] == 0
    torch.testing.assert_close(got[0, 1:], torch.stack([lsm[0, 0, 1], lsm[0, 1, 3]]))


def _float64_scores(hidden, weight, bias, index):
    logits = hidden.double() @ weight.double().T + bias.double()
    logp = torch.log_softmax(logits, -1)
    p = logp.exp()
    return {
        "logps": logp.gather(1, index[:, None]).squeeze(1),
        "entropy": -(p * logp).sum(-1),
        "mean_logits": logits.mean(-1),
        "log_sum_sq": (p * p).sum(-1).log(),
        "top1": (logits.argmax(-1) == index).double(),
    }


@pytest.mark.parametrize("softmax_elements", [None, 46])  # 46: two rows of the softmax at a time, 2 + 2 + 1 a chunk
def test_linear_logps_values_stats_and_gradients_match_float64_over_several_chunks(monkeypatch, softmax_elements):
    if softmax_elements:
        monkeypatch.setattr(logprobs, "SOFTMAX_ELEMENTS", softmax_elements)
    torch.manual_seed(0)
    hidden = torch.randn(37, 8, requires_grad=True)
    weight = torch.randn(23, 8, requires_grad=True)
    bias = torch.randn(23, requires_grad=True)
    index = torch.randint(0, 23, (37,))
    upstream = torch.randn(37)
    got = linear_logps(hidden, weight, index, bias, stats=True, log_sum_sq=True, chunk_size=5)  # 8 chunks
    (got.logps * upstream).sum().backward()
    leaves = [t.detach().double().requires_grad_() for t in (hidden, weight, bias)]
    ref = _float64_scores(*leaves, index)
    (ref["logps"] * upstream.double()).sum().backward()
    for name, expected in ref.items():
        torch.testing.assert_close(getattr(got, name).double(), expected.detach(), atol=1e-5, rtol=1e-5)
    for leaf, expected in zip((hidden, weight, bias), leaves):
        torch.testing.assert_close(leaf.grad.double(), expected.grad, atol=1e-5, rtol=1e-5)
    assert not got.entropy.requires_grad and not got.top1.requires_grad


def test_linear_logps_top1_counts_the_first_of_tied_maxima_and_needs_no_bias():
    hidden = torch.ones(2, 1)
    weight = torch.tensor([[1.0], [1.0], [0.0]])  # logits [1, 1, 0] for both rows
    got = linear_logps(hidden, weight, torch.tensor([0, 1]), stats=True)
    assert got.top1.tolist() == [1.0, 0.0]
    expected = 1 - math.log(2 * math.e + 1)
    torch.testing.assert_close(got.logps, torch.tensor([expected, expected]))
    assert got.log_sum_sq is None


def test_linear_logps_default_chunk_is_bounded_by_the_vocabulary():
    """With a large vocabulary the default chunk holds CHUNK_ELEMENTS logits: here 2 rows of 2^23."""
    from posttrain.losses import logprobs

    calls = []
    original = logprobs._chunk_logits
    logprobs._chunk_logits = lambda h, *rest: calls.append(h.shape[0]) or original(h, *rest)
    try:
        vocab = logprobs.CHUNK_ELEMENTS // 2
        hidden, weight = torch.randn(5, 1), torch.randn(vocab, 1)
        with torch.no_grad():
            linear_logps(hidden, weight, torch.zeros(5, dtype=torch.long))
    finally:
        logprobs._chunk_logits = original
    assert calls == [2, 2, 1]
