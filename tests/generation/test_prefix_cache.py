"""Trained sequences with gradient and their no-gradient continuations read from the attention cache
(posttrain/training/prefix_cache.py, KTO's KL pairs). The reference is the model on each sequence alone, unpadded,
in float64: log-probs and the parameters' gradients must agree to rounding, with sdpa and eager attention, for
continuations that share the whole prompt, more than the prompt, nothing at all, and whose completion is one
token long."""

import pytest
import torch

from posttrain import KTOConfig, KTOTrainer
from posttrain.models.tiny import build_tiny_model
from posttrain.trainers import kto as kto_module
from posttrain.training.prefix_cache import trained_and_continuation_logps

# (prompt, completion) of the trained sequences, then of their continuations: continuation i is prompt i with
# another completion: 0 takes 3's, 1 one beginning like its own (shares prompt + 2 tokens), 2 a one-token one,
# 3 shares nothing (another first token), 4 takes 0's.
PROMPTS = [[5, 9, 13, 20, 7, 8, 30, 31], [40, 41, 42], [77, 78, 79, 80, 81], [90, 91], [60, 61, 62, 63, 64, 65]]
TRAINED = [[100, 101, 102, 103], [110, 111, 112, 113, 114], [120, 121], [130, 131, 132, 133, 134, 135, 136], [140]]
CONTINUATIONS = [
    (PROMPTS[0], TRAINED[3]),
    (PROMPTS[1], [110, 111, 150, 151]),
    (PROMPTS[2], [160]),
    ([300] + PROMPTS[3][1:], [170, 171, 172]),
    (PROMPTS[4], TRAINED[0]),
]
SEQUENCES = list(zip(PROMPTS, TRAINED)) + CONTINUATIONS


def _batch() -> dict[str, torch.Tensor]:
    width = max(len(p) + len(c) for p, c in SEQUENCES)
    ids = torch.zeros(len(SEQUENCES), width, dtype=torch.long)
    attention = torch.zeros_like(ids)
    completion = torch.zeros_like(ids)
    for row, (prompt, tail) in enumerate(SEQUENCES):
        ids[row, : len(prompt) + len(tail)] = torch.tensor(prompt + tail)
        attention[row, : len(prompt) + len(tail)] = 1
        completion[row, len(prompt) : len(prompt) + len(tail)] = 1
    return {"input_ids": ids, "attention_mask": attention, "completion_mask": completion}


@pytest.fixture()
def model(model64):
    return model64


def _alone(model, prompt, tail):
    """Summed completion log-prob of one sequence through the model alone."""
    ids = torch.tensor([prompt + tail])
    logp = model(input_ids=ids).logits[0, len(prompt) - 1 : -1].log_softmax(-1)
    return logp.gather(1, ids[0, len(prompt) :, None]).sum()


def test_trained_and_continuation_logps_match_each_sequence_alone(model):
    _check_against_each_sequence_alone(model)


@pytest.mark.parametrize("family", ["qwen3", "phi3", "qwen3_moe", "gemma3"])
def test_other_families(tokenizer, family):
    """Any family with plain caches; sliding-window caches (Gemma 3's, 16 tokens: longer than each sequence, shorter
    than the packed rows) keep the last slots of a packed row, which the continuations do not read: refused, KTO
    then scores the KL pairs in one forward."""
    window = {"sliding_window": 16, "final_logit_softcapping": None} if family == "gemma3" else {}
    model = build_tiny_model(tokenizer, seed=3, family=family, **window).double()
    if family == "qwen3_moe":
        model.set_experts_implementation("eager")  # (grouped_mm has no float64 kernel)
    if family == "gemma3":
        assert _batch()["input_ids"].shape[1] <= 16
        assert trained_and_continuation_logps(model, _batch(), len(PROMPTS)) is None
    else:
        _check_against_each_sequence_alone(model)


def _check_against_each_sequence_alone(model):
    n = len(PROMPTS)
    weights = torch.tensor([0.3, -1.2, 0.8, 2.0, -0.5], dtype=torch.float64)

    model.zero_grad()
    result = trained_and_continuation_logps(model, _batch(), n)
    assert result is not None
    trained, continuation = result
    assert not continuation.requires_grad
    (trained.logps * weights).sum().backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters()}

    model.zero_grad()
    expected = torch.stack([_alone(model, p, c) for p, c in SEQUENCES])
    (expected[:n] * weights).sum().backward()
    torch.testing.assert_close(trained.logps.double(), expected[:n].detach().float().double(), rtol=1e-6, atol=1e-5)
    torch.testing.assert_close(continuation.double(), expected[n:].detach().float().double(), rtol=1e-6, atol=1e-5)
    assert trained.token_counts.tolist() == [len(c) for c in TRAINED]
    for name, p in model.named_parameters():
        torch.testing.assert_close(grads[name], p.grad, rtol=1e-5, atol=1e-6, msg=name)  # float32 sums


def test_not_used_with_gradient_checkpointing_or_left_padding(model):
    batch = _batch()
    model.activation_checkpointing_enable()
    assert trained_and_continuation_logps(model, batch, len(PROMPTS)) is None
    model.activation_checkpointing_disable()
    left = {k: v.flip(-1) for k, v in batch.items()}
    assert trained_and_continuation_logps(model, left, len(PROMPTS)) is None


def test_kto_trainer_takes_the_cache_route_and_matches_the_one_forward_route(
    tmp_path, tiny_model_path, tokenizer, monkeypatch
):
    """The KTO loss and its gradient are the same whichever way the KL pairs are scored; the default is the cache."""
    from datasets import Dataset

    rows = Dataset.from_list(
        [
            {"prompt": f"question {'x ' * (1 + 3 * i % 7)}is", "completion": f" answer {'y ' * i}", "label": i % 2 == 0}
            for i in range(8)
        ]
    )
    args = KTOConfig(
        output_dir=str(tmp_path),
        per_device_train_batch_size=8,
        max_length=64,
        report_to="none",
        use_cpu=True,
        bf16=False,
        disable_tqdm=True,
    )
    trainer = KTOTrainer(
        build_tiny_model(tokenizer, seed=0),
        ref_model=build_tiny_model(tokenizer, seed=1),
        args=args,
        train_dataset=rows,
        processing_class=tokenizer,
    )
    batch = trainer.data_collator([trainer.train_dataset[i] for i in range(8)])
    model = trainer.model.train()

    calls = []
    real = kto_module.trained_and_continuation_logps
    monkeypatch.setattr(kto_module, "trained_and_continuation_logps", lambda *a, **k: calls.append(1) or real(*a, **k))

    def loss_and_grads():
        model.zero_grad()
        loss = trainer.compute_loss(model, batch)
        loss.backward()
        with torch.no_grad():
            kl_logps = trainer._policy_logps(model, batch, 8)[1]
        return loss.item(), kl_logps, [p.grad.clone() for p in model.parameters()]

    cached_loss, cached_kl, cached_grads = loss_and_grads()
    assert len(calls) == 2
    monkeypatch.setattr(kto_module, "trained_and_continuation_logps", lambda *a, **k: None)
    fused_loss, fused_kl, fused_grads = loss_and_grads()
    assert cached_loss == pytest.approx(fused_loss, rel=1e-5)
    torch.testing.assert_close(cached_kl, fused_kl, rtol=1e-5, atol=1e-4)
    for a, b in zip(cached_grads, fused_grads):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)
