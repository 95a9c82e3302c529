"""SFT token losses (NLL, DFT, label smoothing) and their metrics against float64 references, full and chunked."""

import math

import pytest
import torch

from posttrain.losses.sft import IGNORE_INDEX, chunked_token_loss_sums, token_loss_sums


def _batch(seed=0, vocab=11):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(2, 6, vocab, generator=g) * 3
    labels = torch.randint(0, vocab, (2, 6), generator=g)
    labels[0, :2] = IGNORE_INDEX
    labels[1, 4] = IGNORE_INDEX
    return logits, labels


def _reference(logits, labels, loss_type="nll", eps=0.0):
    """Per-token loop in float64, from the formulas: NLL -log p(y); DFT -p(y) log p(y) (p(y) a constant);
    label smoothing (1-eps)(-log p(y)) + eps * mean_v(-log p(v)); entropy -sum_v p log p."""
    loss = correct = count = entropy = 0.0
    for b in range(labels.shape[0]):
        for t in range(labels.shape[1] - 1):
            y = int(labels[b, t + 1])
            if y == IGNORE_INDEX:
                continue
            z = [float(v) for v in logits[b, t].double()]
            top = max(z)
            log_norm = top + math.log(sum(math.exp(v - top) for v in z))
            logp = [v - log_norm for v in z]
            if loss_type == "dft":
                loss += -math.exp(logp[y]) * logp[y]
            else:
                loss += (1 - eps) * -logp[y] + eps * sum(-v for v in logp) / len(logp)
            correct += int(max(range(len(z)), key=lambda i: z[i]) == y)
            entropy += -sum(math.exp(v) * v for v in logp)
            count += 1
    return loss, correct, count, entropy


@pytest.mark.parametrize("loss_type,eps", [("nll", 0.0), ("dft", 0.0), ("nll", 0.1)])
def test_token_sums_match_float64_reference(loss_type, eps):
    logits, labels = _batch()
    sums = token_loss_sums(logits, labels, loss_type, eps)
    loss, correct, count, entropy = _reference(logits, labels, loss_type, eps)
    assert count == 8 and int(sums.count) == count and int(sums.correct) == correct
    assert sums.loss.item() == pytest.approx(loss, rel=1e-6)
    assert sums.entropy.item() == pytest.approx(entropy, rel=1e-6)
    assert not sums.entropy.requires_grad


def test_dft_gradient_treats_the_probability_as_a_constant():
    logits, labels = _batch(1)
    logits.requires_grad_(True)
    token_loss_sums(logits, labels, "dft").loss.backward()
    # d/dz of -c * log softmax(z)_y with c = p_y held fixed: -p_y * (onehot(y) - softmax(z)).
    expected = torch.zeros_like(logits, dtype=torch.float64)
    for b in range(2):
        for t in range(5):
            y = int(labels[b, t + 1])
            if y == IGNORE_INDEX:
                continue
            p = torch.softmax(logits[b, t].detach().double(), -1)
            onehot = torch.nn.functional.one_hot(torch.tensor(y), p.numel()).double()
            expected[b, t] = -p[y] * (onehot - p)
    torch.testing.assert_close(logits.grad.double(), expected, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("loss_type,eps", [("nll", 0.0), ("dft", 0.0), ("nll", 0.2)])
def test_chunked_sums_and_gradients_equal_full_logits(loss_type, eps):
    g = torch.Generator().manual_seed(3)
    hidden = torch.randn(2, 6, 8, generator=g, requires_grad=True)
    weight = torch.randn(11, 8, generator=g, requires_grad=True)
    _, labels = _batch(2)
    full = token_loss_sums(hidden @ weight.T, labels, loss_type, eps)
    full.loss.backward()
    grads = hidden.grad.clone(), weight.grad.clone()
    hidden.grad = weight.grad = None
    chunked = chunked_token_loss_sums(hidden, weight, labels, chunk_size=3, loss_type=loss_type, label_smoothing=eps)
    chunked.loss.backward()
    torch.testing.assert_close(chunked.loss, full.loss)
    torch.testing.assert_close(chunked.entropy, full.entropy)
    assert int(chunked.correct) == int(full.correct) and int(chunked.count) == int(full.count)
    torch.testing.assert_close(hidden.grad, grads[0])
    torch.testing.assert_close(weight.grad, grads[1])
