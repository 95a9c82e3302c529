"""Mixture-of-Experts models (Qwen3-MoE, Mixtral) train with SFT, DPO and GRPO: two optimizer steps each, with the
router's load-balancing loss logged and joined, and every expert, router and attention weight moved. The experts
compute as transformers groups them (`grouped_mm`, its default), which the fast forward runs as it is."""

import pytest
import torch
from datasets import Dataset

from posttrain import DPOConfig, DPOTrainer, GRPOConfig, GRPOTrainer, SFTConfig, SFTTrainer
from posttrain.models.tiny import MOE_FAMILIES, save_tiny_model

WORDS = "the cat sat on a mat and then it ran far away from the big red dog".split()
COMMON = dict(
    max_steps=2,
    logging_steps=1,
    learning_rate=1e-2,
    seed=0,
    use_cpu=True,
    bf16=False,
    report_to="none",
    save_strategy="no",
    disable_tqdm=True,
    per_device_train_batch_size=4,
)


def _text(i: int) -> str:
    return " ".join(WORDS[i % 5 : i % 5 + 4 + i % 7])


def _sft(path, output_dir):
    data = Dataset.from_list([{"text": _text(i)} for i in range(8)])
    args = SFTConfig(output_dir=output_dir, packing=True, max_length=32, **COMMON)
    return SFTTrainer(path, args=args, train_dataset=data)


def _dpo(path, output_dir):
    data = Dataset.from_list([{"prompt": _text(i), "chosen": " red", "rejected": " " + _text(i + 3)} for i in range(8)])
    return DPOTrainer(path, args=DPOConfig(output_dir=output_dir, max_length=32, **COMMON), train_dataset=data)


def _grpo(path, output_dir):
    data = Dataset.from_list([{"prompt": _text(i)} for i in range(8)])
    args = GRPOConfig(output_dir=output_dir, num_generations=4, max_completion_length=6, **COMMON)
    return GRPOTrainer(
        path, lambda completion_ids, **kwargs: [len(c) / 6.0 for c in completion_ids], args=args, train_dataset=data
    )


@pytest.mark.parametrize("method", [_sft, _dpo, _grpo], ids=["sft", "dpo", "grpo"])
@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_moe_models_train(tmp_path, family, method):
    path = save_tiny_model(tmp_path / family, family=family, router_aux_loss_coef=0.01)
    trainer = method(path, str(tmp_path / "out"))
    assert trainer.model.config._experts_implementation == "grouped_mm"
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    trainer.train()
    logs = [h for h in trainer.state.log_history if "loss" in h]
    assert len(logs) == 2 and all(torch.isfinite(torch.tensor(h["loss"])) for h in logs)
    assert all(h["aux_loss"] > 0 for h in logs)
    moved = {n for n, p in trainer.model.named_parameters() if not torch.equal(p.detach(), before[n])}
    for part in ("experts", "gate.weight", "self_attn.q_proj"):
        assert any(part in n for n in moved), part


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_load_balancing_loss_on_the_shared_layout_is_the_padded_batchs(tokenizer, family, monkeypatch):
    """DPO's forward of an MoE model whose balancing loss is wanted takes the shared-prompt layout: the router logits
    recorded there, each position weighted by the padded-batch tokens it stands for, give the padded batch's loss
    (transformers' own function on the 2D mask), and the log-probs are the padded batch's, in float64."""
    from posttrain.data.preference import PreferenceCollator
    from posttrain.models.tiny import build_tiny_model
    from posttrain.training import preference

    model = build_tiny_model(tokenizer, seed=2, family=family).double()
    model.set_experts_implementation("eager")  # (grouped_mm has no float64 kernel)
    prompt = tokenizer("the cat and the dog are in the tree and the sun")["input_ids"]
    rows = [
        {"prompt_ids": prompt[: 6 + i], "chosen_ids": [5 + i, 6, 7], "rejected_ids": [8, 9 + i, 10, 11, 12][: 2 + i]}
        for i in range(3)
    ]
    batch = PreferenceCollator(tokenizer.pad_token_id)(rows)
    runs = {}
    for layout in ("shared", "padded"):
        if layout == "padded":
            monkeypatch.setattr(preference, "model_shared_layout", lambda *args: None)
        seen = []
        handle = model.model.register_forward_pre_hook(
            lambda m, a, k, seen=seen: seen.append(k["input_ids"].shape), with_kwargs=True
        )
        result = preference.sequence_logps(model, batch, router_logits=True)
        handle.remove()
        runs[layout] = result, seen[0][0] * seen[0][1]
    (shared, shared_slots), (padded, padded_slots) = runs["shared"], runs["padded"]
    assert shared_slots < padded_slots  # the layout ran on fewer positions
    torch.testing.assert_close(shared.aux_loss, padded.aux_loss, rtol=1e-10, atol=0)
    torch.testing.assert_close(shared.logps, padded.logps, rtol=1e-10, atol=1e-10)
    with torch.no_grad():
        reference = model(
            input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], output_router_logits=True
        )
    torch.testing.assert_close(padded.aux_loss, reference.aux_loss, rtol=1e-12, atol=0)


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_sft_repacks_padded_moe_batches_with_the_padded_balancing_loss(tmp_path, tokenizer, family):
    """Padded SFT batches of an MoE model run on repacked rows with the balancing loss on: the loss (token loss plus
    the weighted balancing loss) and every gradient of the padded forward (a float64 model; the token loss sums in
    float32)."""
    from posttrain.models.tiny import build_tiny_model

    model = build_tiny_model(tokenizer, seed=1, family=family, router_aux_loss_coef=0.5).double()
    model.set_experts_implementation("eager")  # (grouped_mm has no float64 kernel)
    data = Dataset.from_list([{"text": " ".join(WORDS[: 2 + (7 * i) % 15])} for i in range(8)])
    args = SFTConfig(output_dir=str(tmp_path), max_length=32, **{**COMMON, "per_device_train_batch_size": 8})
    trainer = SFTTrainer(model, args=args, train_dataset=data, processing_class=tokenizer)
    assert trainer._repack_padded and trainer.router_aux_loss_coef == 0.5
    batch = trainer.data_collator([trainer.train_dataset[i] for i in range(8)])
    from posttrain.models.layouts import repack_padded_batch

    assert repack_padded_batch(dict(batch), batch["labels"], 32) is not None  # worth repacking
    results = []
    for repack in (True, False):
        trainer._repack_padded = repack
        model.zero_grad()
        loss = trainer.compute_loss(model, dict(batch))
        loss.backward()
        results.append((loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}))
    (repacked, repacked_grads), (padded, padded_grads) = results
    torch.testing.assert_close(repacked, padded, rtol=1e-6, atol=0)
    assert repacked_grads.keys() == padded_grads.keys() and any("gate" in n for n in padded_grads)
    for name, grad in padded_grads.items():
        torch.testing.assert_close(repacked_grads[name], grad, rtol=1e-5, atol=1e-7)
