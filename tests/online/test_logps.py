"""The online trainers' shared-prompt forward (posttrain/online/logps.py): each group's prompt computed
once with its completions after it under a 4D mask. The reference is the model on each sequence alone, unpadded,
in float64: log-probs, entropies and the parameters' gradients must agree to rounding, with sdpa and eager attention,
groups of unequal size (one of them split across the batch), completions that begin alike, a prompt of its own,
and completions of every length down to one token."""

import pytest
import torch

from posttrain.online import logps as online_logps
from posttrain.online.logps import completion_logps, shared_prompt_layout

PROMPTS = [[5, 9, 13, 20, 7], [40, 41, 42, 43, 44, 45, 46, 47, 48], [77, 78, 79]]
# (prompt, completion) rows: prompt 0 has four completions (two beginning alike, one placed after prompt 1's), both
# of prompt 1's begin with token 200, which is then computed once too; prompt 2 has one.
ROWS = [
    (0, [100, 101, 102, 103]),
    (0, [100, 101, 150]),
    (1, [200, 201, 202, 203, 204, 205]),
    (0, [160]),
    (1, [200, 211]),
    (2, [220, 221, 222, 223, 224]),
    (0, [170, 171, 172, 173, 174, 175]),
]
PAD = 0


def _batch() -> dict[str, torch.Tensor]:
    prompt_width = max(len(p) for p in PROMPTS)
    width = max(len(c) for _, c in ROWS)
    prompt_ids = torch.full((len(ROWS), prompt_width), PAD)
    prompt_mask = torch.zeros_like(prompt_ids)
    completion_ids = torch.full((len(ROWS), width), PAD)
    completion_mask = torch.zeros_like(completion_ids)
    for row, (p, completion) in enumerate(ROWS):
        prompt = PROMPTS[p]
        prompt_ids[row, prompt_width - len(prompt) :] = torch.tensor(prompt)
        prompt_mask[row, prompt_width - len(prompt) :] = 1
        completion_ids[row, : len(completion)] = torch.tensor(completion)
        completion_mask[row, : len(completion)] = 1
    return {
        "prompt_ids": prompt_ids,
        "prompt_mask": prompt_mask,
        "completion_ids": completion_ids,
        "completion_mask": completion_mask,
    }


@pytest.fixture()
def model(model64):
    return model64


def _unshared(model, batch, temperature):
    """Each sequence through the model alone, without padding: log-probs and entropies [B, T], 0 past the end."""
    width = batch["completion_ids"].shape[1]
    logps, entropy = [], []
    for p, completion in ROWS:
        ids = torch.tensor([PROMPTS[p] + completion])
        logits = model(input_ids=ids).logits[0, len(PROMPTS[p]) - 1 : -1] / temperature
        logp = logits.log_softmax(-1)
        pad = (0, width - len(completion))
        logps.append(torch.nn.functional.pad(logp.gather(1, ids[0, len(PROMPTS[p]) :, None])[:, 0], pad))
        entropy.append(torch.nn.functional.pad(-(logp.exp() * logp).sum(-1), pad))
    return torch.stack(logps), torch.stack(entropy)


def _with_gradients(fn, model, batch, weights):
    model.zero_grad()
    logps, entropy = fn()
    (logps * weights).sum().backward()
    return logps.detach(), entropy.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def test_shared_prompt_route_gives_the_padded_forwards_logps_entropies_and_gradients(model):
    batch, temperature = _batch(), 0.7
    mask = batch["completion_mask"].bool()
    weights = torch.randn(mask.shape, generator=torch.Generator().manual_seed(0), dtype=torch.float64)

    layout = shared_prompt_layout(model, batch)
    assert layout is not None
    inputs, where, _ = layout
    lengths = torch.tensor([len(PROMPTS[p]) + len(c) for p, c in ROWS])
    real = torch.arange(where.shape[1])[None, :] < lengths[:, None]
    # Every prompt once, and prompt 1's common first completion token once: the tokens that fill the slots.
    assert torch.unique(where[real]).numel() == sum(map(len, PROMPTS)) + sum(len(c) for _, c in ROWS) - 1
    assert inputs["input_ids"].numel() < batch["prompt_ids"].numel() + batch["completion_ids"].numel()
    assert inputs["attention_mask"].dim() == 4

    calls = []
    original = online_logps.forward_hidden
    online_logps.forward_hidden = lambda m, i: calls.append(i["input_ids"].shape) or original(m, i)
    try:
        shared = _with_gradients(
            lambda: completion_logps(model, batch, temperature, with_entropy=True), model, batch, weights
        )
    finally:
        online_logps.forward_hidden = original
    assert len(calls) == 1  # the shared route was taken
    reference = _with_gradients(lambda: _unshared(model, batch, temperature), model, batch, weights)

    for got, expected in zip(shared[:2], reference[:2]):
        torch.testing.assert_close(got.double(), expected.double(), atol=1e-7, rtol=0)
        assert torch.all(got[~mask] == 0)
    assert shared[0][mask].abs().min() > 0
    # (Llama's RMSNorm computes in float32 even in a float64 model, so sums taken in another order agree to float32
    # rounding: log-probs here within 1e-8, gradients within 6e-8 of their largest entry.)
    for name, grad in reference[2].items():
        torch.testing.assert_close(shared[2][name], grad, atol=1e-6 * grad.abs().max().item(), rtol=0, msg=name)


def test_the_no_gradient_forward_takes_the_same_route(model):
    """Old-policy and reference log-probs come from the same layout as the training forward."""
    batch = _batch()
    with torch.no_grad():
        logps, entropy = completion_logps(model, batch, 1.0)
        expected, _ = _unshared(model, batch, 1.0)
    assert entropy is None
    torch.testing.assert_close(logps.double(), expected.double(), atol=1e-7, rtol=0)


def test_falls_back_where_the_layout_does_not_apply(model):
    batch = _batch()
    ragged = dict(batch, completion_mask=batch["completion_mask"].clone())
    ragged["completion_mask"][0, 1] = 0  # not right-padded: a hole inside a completion
    assert shared_prompt_layout(model, ragged) is None
    single = {"prompt_ids": torch.tensor([PROMPTS[0]]), "completion_ids": torch.tensor([ROWS[0][1]])}
    single.update(
        prompt_mask=torch.ones_like(single["prompt_ids"]), completion_mask=torch.ones_like(single["completion_ids"])
    )
    assert shared_prompt_layout(model, single) is None  # one sequence without padding: nothing to save
    with torch.no_grad():
        logps, _ = completion_logps(model, single, 1.0)
        expected, _ = _unshared(model, batch, 1.0)
    torch.testing.assert_close(logps, expected[:1, : logps.shape[1]], atol=1e-7, rtol=0)


def test_grpo_trains_the_same_through_the_shared_route(tmp_path, tiny_model_path, monkeypatch):
    """Two steps with a KL term and two passes per round (training, old-policy and reference forwards): every
    forward takes the shared route, and losses, KL and the trained weights are those of the padded route."""
    from test_engine import ParameterSnapshots, logged, low_id_fraction, stopping_model, train

    original = online_logps.shared_prompt_logps
    runs = {}
    for route in ("shared", "padded"):
        taken = []

        def spy(*args, route=route, taken=taken):
            result = original(*args) if route == "shared" else None
            taken.append((torch.is_grad_enabled(), result is not None))
            return result

        monkeypatch.setattr(online_logps, "shared_prompt_logps", spy)
        snapshots = ParameterSnapshots()
        trainer = train(
            stopping_model(tiny_model_path),
            tmp_path / route,
            reward=low_id_fraction,
            callbacks=[snapshots],
            beta=0.1,
            num_iterations=2,
            max_steps=2,
            optim="sgd",
            learning_rate=1.0,
        )
        runs[route] = (trainer, snapshots.after_step[-1])
        if route == "shared":
            assert {grad for grad, _ in taken} == {True, False} and all(shared for _, shared in taken)
    for key in ("loss", "kl"):
        for step in (1, 2):
            assert logged(runs["shared"][0], key, step) == pytest.approx(logged(runs["padded"][0], key, step), abs=1e-5)
    for name, value in runs["padded"][1].items():
        torch.testing.assert_close(runs["shared"][1][name], value, atol=1e-6, rtol=0, msg=name)
