"""posttrain.losses.chunked_head (TRL's `trl.kernels` path) against TRL 1.16's ChunkedLogProbFunction and
ChunkedDivergenceFunction (their torch path, on the CPU) on the same tensors: values and gradients, with the
temperature, logit scale and soft cap; and the log-probs against float64 full logits."""

import importlib

import pytest
import torch
from _trl import import_trl

from posttrain.kernels import ChunkedLogProbFunction
from posttrain.kernels.chunked_divergence import ChunkedDivergenceFunction

N, H, V = 37, 16, 203


@pytest.fixture(scope="module")
def trl_kernels():
    import_trl()
    return importlib.import_module("trl.kernels.chunked_logprob"), importlib.import_module(
        "trl.kernels.chunked_divergence"
    )


def _tensors(seed, bias=True, n=N, vocab=V):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, H, generator=g)
    weight = torch.randn(vocab, H, generator=g) / 2
    b = torch.randn(vocab, generator=g) if bias else None
    targets = torch.randint(0, vocab, (n,), generator=g)
    targets[::3] = (hidden @ weight.T + (0 if b is None else b)).argmax(-1)[::3]  # some targets are the top-1
    return hidden, weight, b, targets


def _grads(fn, hidden, weight, bias, *rest, weights=(1.0, 0.3)):
    leaves = [t.clone().requires_grad_(True) if t is not None else None for t in (hidden, weight, bias)]
    outputs = fn(*leaves, *rest)
    loss = sum(w * o.sum() for w, o in zip(weights, outputs) if o is not None and o.requires_grad)
    loss.backward()
    return [o.detach() if o is not None else None for o in outputs], [t.grad if t is not None else None for t in leaves]


@pytest.mark.parametrize(
    "temperature, softcap, scale, bias, chunk",
    [(1.0, None, 1.0, True, 64), (0.7, 30.0, 1.0, True, 8), (1.3, None, 0.5, False, 1), (1.0, 5.0, 2.0, True, 4096)],
)
def test_logprobs_and_statistics_equal_trls(trl_kernels, temperature, softcap, scale, bias, chunk):
    hidden, weight, b, targets = _tensors(0, bias)
    args = (targets, temperature, chunk, softcap, scale)
    theirs, their_grads = _grads(trl_kernels[0].ChunkedLogProbFunction.apply, hidden, weight, b, *args)
    ours, our_grads = _grads(ChunkedLogProbFunction.apply, hidden, weight, b, *args)
    for mine, expected in zip(ours[:4], theirs[:4]):
        torch.testing.assert_close(mine, expected, rtol=1e-5, atol=1e-5)
    assert torch.equal(ours[4], theirs[4]) and 0 < int(ours[4].sum()) < N
    for mine, expected in zip(our_grads, their_grads):
        if expected is not None:
            torch.testing.assert_close(mine, expected, rtol=1e-4, atol=1e-5)


def test_logprobs_match_float64_full_logits_and_leave_out_unrequested_outputs():
    hidden, weight, b, targets = (t.double() if t.is_floating_point() else t for t in _tensors(1))
    logprobs, entropy, sq, mean, top1 = ChunkedLogProbFunction.apply(hidden, weight, b, targets, 0.8, 3, None, 1.0, ())
    z = (hidden @ weight.T + b) / 0.8
    expected = z.log_softmax(-1).gather(-1, targets[:, None]).squeeze(-1)
    assert logprobs.dtype == torch.float64 and (entropy, sq, mean, top1) == (None, None, None, None)
    torch.testing.assert_close(logprobs, expected, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize(
    "beta, temperature, softcaps, scales",
    [(0.0, 1.0, (None, None), (1.0, 1.0)), (1.0, 0.8, (20.0, None), (1.0, 0.5)), (0.4, 1.2, (None, 7.0), (2.0, 1.0))],
)
def test_divergence_equals_trls_and_trains_the_student_only(trl_kernels, beta, temperature, softcaps, scales):
    student, s_weight, s_bias, _ = _tensors(2)
    teacher, t_weight, t_bias, _ = _tensors(3)
    rest = (beta, temperature, scales[0], softcaps[0], scales[1], softcaps[1])

    def run(fn):
        leaves = [t.clone().requires_grad_(True) for t in (student, s_weight, s_bias, teacher, t_weight)]
        divergence, entropy = fn(*leaves[:3], leaves[3], leaves[4], t_bias, *rest)
        divergence.sum().backward()
        return divergence.detach(), entropy, [t.grad for t in leaves]

    ours, theirs = run(ChunkedDivergenceFunction.apply), run(trl_kernels[1].ChunkedDivergenceFunction.apply)
    assert bool((ours[0] > 0).all())
    torch.testing.assert_close(ours[0], theirs[0], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(ours[1], theirs[1], rtol=1e-5, atol=1e-6)
    for mine, expected in zip(ours[2][:3], theirs[2][:3]):
        torch.testing.assert_close(mine, expected, rtol=1e-4, atol=1e-6)
    assert ours[2][3] is None and ours[2][4] is None  # the teacher gets no gradient, as in TRL
    assert not ours[1].requires_grad


def test_a_zero3_partitioned_weight_is_read_whole_and_sized_by_its_full_shape(monkeypatch):
    """Under ZeRO-3 the head's weight is an empty tensor outside its gather (its shape in `ds_shape`): the chunks
    are sized by the full vocabulary and computed on the gathered weight, here and in the recomputation."""
    import contextlib

    from posttrain.losses import chunked_head

    torch.manual_seed(0)
    hidden = torch.randn(6, 8, dtype=torch.float64, requires_grad=True)
    full = torch.randn(11, 8, dtype=torch.float64)
    targets = torch.randint(0, 11, (6,))
    # (frozen: the weight's own gradient goes through DeepSpeed's hooks, which a stand-in cannot play)
    weight = torch.nn.Parameter(torch.empty(0, dtype=torch.float64), requires_grad=False)
    weight.ds_shape, gathers = full.shape, []

    @contextlib.contextmanager
    def gather(w, b):  # what deepspeed.zero.GatheredParameters does to the stand-in
        gathers.append(w is weight)
        weight.data = full
        try:
            yield
        finally:
            weight.data = torch.empty(0, dtype=torch.float64)

    monkeypatch.setattr(chunked_head, "gather_partitioned", gather)
    logp, *_ = chunked_head.chunked_logprobs(hidden, weight, None, targets, 1.0, 2, outputs=())
    expected = (hidden @ full.T).log_softmax(-1).gather(-1, targets[:, None])[:, 0]
    torch.testing.assert_close(logp, expected, rtol=1e-12, atol=1e-12)
    logp.sum().backward()
    reference = hidden.detach().requires_grad_()
    (reference @ full.T).log_softmax(-1).gather(-1, targets[:, None]).sum().backward()
    torch.testing.assert_close(hidden.grad, reference.grad, rtol=1e-12, atol=1e-12)
    assert len(gathers) >= 2 and all(gathers)  # (forward and recomputation)
