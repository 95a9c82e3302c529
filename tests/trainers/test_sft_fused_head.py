"""The fused chunked SFT loss (gradients computed chunk by chunk in the forward pass) against a float64 reference
written from the formulas, when SFTTrainer turns it on by default, and padded batches computed on repacked rows."""

import pytest
import torch
from datasets import Dataset

from posttrain import SFTConfig, SFTTrainer
from posttrain.errors import ConfigError
from posttrain.losses import logprobs
from posttrain.losses.sft import IGNORE_INDEX, chunked_token_loss_sums


def _reference(hidden, weight, bias, labels, loss_type, eps):
    """float64 sums over trained targets, from the per-token formulas (not from posttrain's code)."""
    h, w = hidden.double(), weight.double()
    logits = h @ w.T + (bias.double() if bias is not None else 0)
    loss = torch.zeros((), dtype=torch.float64)
    entropy, correct, count = 0.0, 0, 0
    for b in range(labels.shape[0]):
        for t in range(labels.shape[1] - 1):
            y = int(labels[b, t + 1])
            if y == IGNORE_INDEX:
                continue
            logp = logits[b, t] - torch.logsumexp(logits[b, t], 0)
            if loss_type == "dft":
                loss = loss - logp[y].detach().exp() * logp[y]
            else:
                loss = loss - (1 - eps) * logp[y] - eps * logp.mean()
            p = logp.detach().exp()
            entropy -= float((p * logp.detach()).sum())
            correct += int(int(logp.argmax()) == y)
            count += 1
    return loss, entropy, correct, count


@pytest.mark.parametrize(
    "loss_type,eps,chunk", [("nll", 0.0, 4), ("dft", 0.0, 3), ("nll", 0.1, 100), ("dft", 0.0, 100)]
)
@pytest.mark.parametrize("softmax_elements", [None, 39])  # 39: three rows of the softmax at a time
def test_fused_sums_and_scaled_gradients_match_float64_formulas(monkeypatch, loss_type, eps, chunk, softmax_elements):
    if softmax_elements:
        monkeypatch.setattr(logprobs, "SOFTMAX_ELEMENTS", softmax_elements)
    g = torch.Generator().manual_seed(7)
    hidden = torch.randn(2, 7, 6, generator=g, requires_grad=True)
    weight = torch.randn(13, 6, generator=g, requires_grad=True)
    bias = torch.randn(13, generator=g, requires_grad=True)
    labels = torch.randint(0, 13, (2, 7), generator=g)
    labels[0, :3] = IGNORE_INDEX
    labels[1, 5] = IGNORE_INDEX
    sums = chunked_token_loss_sums(
        hidden, weight, labels, bias, chunk_size=chunk, loss_type=loss_type, label_smoothing=eps
    )
    (sums.loss / 2.5).backward()  # the trainer divides by the effective batch's token count
    ref_loss, ref_entropy, ref_correct, ref_count = _reference(hidden, weight, bias, labels, loss_type, eps)
    ref_grads = torch.autograd.grad(ref_loss / 2.5, (hidden, weight, bias))
    torch.testing.assert_close(sums.loss.double(), ref_loss.detach(), rtol=1e-5, atol=1e-5)
    assert sums.entropy.item() == pytest.approx(ref_entropy, rel=1e-5)
    assert int(sums.correct) == ref_correct and int(sums.count) == ref_count
    for got, want in zip((hidden.grad, weight.grad, bias.grad), ref_grads):
        torch.testing.assert_close(got.double(), want.double(), rtol=1e-4, atol=1e-6)
    # Positions whose next token is untrained get no gradient at all.
    assert torch.all(hidden.grad[0, :2] == 0) and torch.all(hidden.grad[1, 4] == 0)


def test_frozen_output_layer_gets_no_gradient_and_hidden_grad_is_unchanged():
    g = torch.Generator().manual_seed(1)
    hidden = torch.randn(1, 9, 5, generator=g, requires_grad=True)
    weight = torch.randn(8, 5, generator=g)
    labels = torch.randint(0, 8, (1, 9), generator=g)
    chunked_token_loss_sums(hidden, weight, labels, chunk_size=2).loss.backward()
    ref_loss = _reference(hidden, weight, None, labels, "nll", 0.0)[0]
    torch.testing.assert_close(hidden.grad, torch.autograd.grad(ref_loss, hidden)[0], rtol=1e-4, atol=1e-6)
    assert weight.grad is None


def test_a_second_backward_is_refused():
    hidden = torch.randn(1, 4, 3, requires_grad=True)
    loss = chunked_token_loss_sums(hidden, torch.randn(5, 3), torch.tensor([[1, 2, 3, 4]])).loss
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="one backward pass"):
        loss.backward()


def _args(tmp_path, **kw):
    base = dict(
        output_dir=str(tmp_path),
        per_device_train_batch_size=2,
        max_steps=1,
        report_to="none",
        use_cpu=True,
        bf16=False,
        save_strategy="no",
        max_length=32,
        disable_tqdm=True,
    )
    return SFTConfig(**{**base, **kw})


def _data():
    return Dataset.from_list([{"prompt": "one plus two", "completion": " three"}] * 4)


def test_chunked_loss_is_the_default_where_it_applies(tmp_path, tiny_model_path):
    assert SFTTrainer(tiny_model_path, args=_args(tmp_path / "a"), train_dataset=_data())._chunked_loss is True
    off = SFTTrainer(tiny_model_path, args=_args(tmp_path / "b", chunked_loss=False), train_dataset=_data())
    assert off._chunked_loss is False
    # compute_loss_func gets the full logits, so the default falls back to them.
    with_func = SFTTrainer(
        tiny_model_path,
        args=_args(tmp_path / "c"),
        train_dataset=_data(),
        compute_loss_func=lambda outputs, labels, num_items_in_batch=None: outputs.logits.sum(),
    )
    assert with_func._chunked_loss is False


def test_default_falls_back_to_full_logits_for_a_lora_output_layer(tmp_path, tiny_model_path):
    from peft import LoraConfig

    lora = LoraConfig(r=4, target_modules=["q_proj", "lm_head"], task_type="CAUSAL_LM")
    trainer = SFTTrainer(tiny_model_path, args=_args(tmp_path), train_dataset=_data(), peft_config=lora)
    assert trainer._chunked_loss is False


def test_loss_chunk_size_must_be_positive(tmp_path):
    with pytest.raises(ConfigError, match="loss_chunk_size=0"):
        _args(tmp_path, loss_chunk_size=0)


@pytest.mark.parametrize("chunked", [True, False])
def test_repacked_padded_batch_gives_the_padded_loss_gradients_and_metrics(tmp_path, tiny_model_path, chunked):
    rows = [{"prompt": "the " * n + "sum is", "completion": " one two" * (1 + n % 3)} for n in (1, 14, 3, 22, 2, 6)]
    args = _args(tmp_path, per_device_train_batch_size=6, chunked_loss=chunked, max_length=64)
    trainer = SFTTrainer(tiny_model_path, args=args, train_dataset=Dataset.from_list(rows))
    assert trainer._repack_padded is True
    batch = trainer.data_collator([trainer.train_dataset[i] for i in range(6)])
    assert "attention_mask" in batch
    trainer.model.train()
    results = []
    from posttrain.training.metric_values import as_floats

    for repack in (False, True):
        trainer._repack_padded = repack
        trainer.model.zero_grad(set_to_none=True)
        trainer._metrics["train"].clear()
        seen = []
        handle = trainer.model.model.register_forward_pre_hook(
            lambda module, args, kwargs, seen=seen: seen.append((args[0] if args else kwargs["input_ids"]).shape),
            with_kwargs=True,
        )
        loss = trainer.compute_loss(trainer.model, dict(batch), num_items_in_batch=None)
        handle.remove()
        loss.backward()
        grads = {n: p.grad.clone() for n, p in trainer.model.named_parameters() if p.grad is not None}
        as_floats(trainer._metrics["train"])  # kept on the device until logged (training/metric_values.py)
        metrics = {k: v[-1] for k, v in trainer._metrics["train"].items()}
        results.append((loss.detach(), grads, metrics, seen[0]))
    (loss0, grads0, metrics0, shape0), (loss1, grads1, metrics1, shape1) = results
    assert shape1[0] < shape0[0] == 6  # the repacked batch has fewer rows
    torch.testing.assert_close(loss1, loss0, rtol=1e-5, atol=1e-6)
    for name, grad in grads0.items():
        torch.testing.assert_close(grads1[name], grad, rtol=1e-4, atol=1e-6)
    assert metrics1["mean_token_accuracy"] == pytest.approx(metrics0["mean_token_accuracy"])
    assert metrics1["entropy"] == pytest.approx(metrics0["entropy"], rel=1e-5)
    assert trainer._input_tokens == 2 * int(batch["attention_mask"].sum())  # counted once per pass, padding excluded
