"""KTOTrainer on the tiny model: the loss against a float64 reference (KL pairs, weights), learning,
accumulation equivalence, unpairing, class-balance checks, the PEFT reference."""

import logging

import pytest
import torch
from datasets import Dataset

from posttrain import KTOConfig, KTOTrainer
from posttrain.errors import ConfigError, DataError
from posttrain.models.tiny import build_tiny_model

FILLERS = ["the cat", "a dog", "the sky", "one tree", "red fish", "blue moon", "two birds", "the sun"]


def _args(tmp_path, **kw):
    base = dict(
        output_dir=str(tmp_path / "out"),
        per_device_train_batch_size=4,
        max_steps=3,
        learning_rate=1e-3,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        use_cpu=True,
        bf16=False,
        seed=0,
        max_length=64,
        disable_tqdm=True,
    )
    base.update(kw)
    return KTOConfig(**base)


def _unpaired(n=8):
    """Alternating desirable ('good ...') and undesirable ('bad ...') completions of different lengths."""
    return Dataset.from_list(
        [
            {
                "prompt": f"{FILLERS[i % len(FILLERS)]} is",
                "completion": (" good" if i % 2 == 0 else " bad")
                + " and"
                + f" {FILLERS[(3 * i) % len(FILLERS)]}" * (1 + i % 3),
                "label": i % 2 == 0,
            }
            for i in range(n)
        ]
    )


def _logp64(model, ids, mask):
    """Float64 summed log-probs of the masked tokens of one unpadded sequence."""
    logits = model(input_ids=torch.tensor([ids])).logits[0].double()
    logps = torch.log_softmax(logits[:-1], -1).gather(-1, torch.tensor(ids[1:])[:, None])[:, 0]
    return (logps * torch.tensor(mask[1:], dtype=torch.float64)).sum()


def test_loss_matches_float64_reference_with_kl_pairs_and_weights(tmp_path, tiny_model_path, tokenizer):
    ref = build_tiny_model(tokenizer, seed=3)
    beta, w_d, w_u = 2.0, 1.3, 0.7
    trainer = KTOTrainer(
        tiny_model_path,
        args=_args(tmp_path, beta=beta, desirable_weight=w_d, undesirable_weight=w_u),
        train_dataset=_unpaired(6),
        ref_model=ref,
    )
    assert trainer.ref_model is ref
    rows = [trainer.train_dataset[i] for i in range(6)]
    batch = trainer.data_collator(rows)
    policy = trainer.model.eval()
    with torch.no_grad():
        loss = trainer.compute_loss(policy, batch).item()
        logratios, kl_logratios = [], []
        for i, row in enumerate(rows):
            logratios.append(
                _logp64(policy, row["input_ids"], row["completion_mask"])
                - _logp64(ref, row["input_ids"], row["completion_mask"])
            )
            # TRL's pairing: in runs of per_device_train_batch_size (4) rows, prompt i takes row i - 1's
            # completion, the run's first row its last row's.
            run_start = i - i % 4
            other = rows[i - 1] if i > run_start else rows[min(run_start + 4, len(rows)) - 1]
            start, other_start = row["completion_mask"].index(1), other["completion_mask"].index(1)
            ids = row["input_ids"][:start] + other["input_ids"][other_start:]
            mask = [0] * start + other["completion_mask"][other_start:]
            kl_logratios.append(_logp64(policy, ids, mask) - _logp64(ref, ids, mask))
    z0 = max(0.0, torch.stack(kl_logratios).mean().item())
    assert z0 > 0  # the reference point is in play for this seed
    expected = []
    for row, r in zip(rows, logratios):
        if row["label"]:
            expected.append(w_d * (1 - torch.sigmoid(beta * (r - z0))))
        else:
            expected.append(w_u * (1 - torch.sigmoid(beta * (z0 - r))))
    assert loss == pytest.approx(torch.stack(expected).mean().item(), rel=1e-5)
    metrics = {k: v[-1] for k, v in trainer._metrics["eval"].items()}
    assert metrics["kl"] == pytest.approx(z0, rel=1e-4)
    desirable = [beta * r.item() for row, r in zip(rows, logratios) if row["label"]]
    undesirable = [beta * r.item() for row, r in zip(rows, logratios) if not row["label"]]
    assert metrics["rewards/chosen"] == pytest.approx(sum(desirable) / 3, rel=1e-4)
    assert metrics["rewards/rejected"] == pytest.approx(sum(undesirable) / 3, rel=1e-4)
    assert metrics["rewards/margins"] == pytest.approx((sum(desirable) - sum(undesirable)) / 3, rel=1e-4)


def test_apo_zero_unpaired_has_no_kl_pairs(tmp_path, tiny_model_path, tokenizer):
    ref = build_tiny_model(tokenizer, seed=3)
    trainer = KTOTrainer(
        tiny_model_path,
        args=_args(tmp_path, loss_type="apo_zero_unpaired", beta=2.0),
        train_dataset=_unpaired(4),
        ref_model=ref,
    )
    rows = [trainer.train_dataset[i] for i in range(4)]
    batch = trainer.data_collator(rows)
    assert batch["input_ids"].shape[0] == 4
    with torch.no_grad():
        loss = trainer.compute_loss(trainer.model.eval(), batch).item()
        expected = []
        for row in rows:
            r = _logp64(trainer.model, row["input_ids"], row["completion_mask"]) - _logp64(
                ref, row["input_ids"], row["completion_mask"]
            )
            expected.append(1 - torch.sigmoid(2.0 * r) if row["label"] else torch.sigmoid(2.0 * r))
    assert loss == pytest.approx(torch.stack(expected).mean().item(), rel=1e-5)
    assert trainer._metrics["eval"]["kl"] == [0.0]  # TRL logs z0 = 0 for this loss


def test_desirable_reward_rises_above_undesirable(tmp_path, tiny_model_path):
    trainer = KTOTrainer(
        tiny_model_path, args=_args(tmp_path, max_steps=8, learning_rate=1e-2), train_dataset=_unpaired(16)
    )
    trainer.train()
    logs = [h for h in trainer.state.log_history if "loss" in h]
    assert logs[0]["loss"] == pytest.approx(0.5, abs=1e-4)  # policy = reference: every reward is 0
    assert logs[-1]["loss"] < 0.35
    assert logs[-1]["rewards/chosen"] > 0 > logs[-1]["rewards/rejected"]
    for key in ("kl", "logps/chosen", "logps/rejected", "rewards/margins"):
        assert key in logs[-1]


def _one_step_params(tmp_path, tiny_model_path, data, **kw):
    trainer = KTOTrainer(
        tiny_model_path,
        args=_args(
            tmp_path,
            max_steps=1,
            learning_rate=1.0,
            optim="sgd",
            lr_scheduler_type="constant",
            desirable_weight=1.3,
            **kw,
        ),
        train_dataset=data,
    )
    trainer.train()
    return {n: p.detach().clone() for n, p in trainer.model.named_parameters()}


def test_batch_times_accumulation_equivalence(tmp_path, tiny_model_path):
    # At the first step the policy is its reference, so z0 = 0 in every micro-batch and only the reduction
    # (the sum over the effective batch's examples) decides whether the updates agree.
    data = _unpaired(8)
    full = _one_step_params(tmp_path / "a", tiny_model_path, data, per_device_train_batch_size=8)
    split = _one_step_params(
        tmp_path / "b", tiny_model_path, data, per_device_train_batch_size=3, gradient_accumulation_steps=3
    )  # micro-batches of 3, 3 and 2 examples
    for name in full:
        torch.testing.assert_close(full[name], split[name], atol=1e-6, rtol=1e-5)


def test_paired_data_is_unpaired_with_a_log_line(tmp_path, tiny_model_path, tokenizer, caplog):
    paired = Dataset.from_list(
        [
            {"chosen": "the sky is blue", "rejected": "the sky is red"},
            {"chosen": "a cat is good", "rejected": "a cat is bad"},
        ]
    )
    with caplog.at_level(logging.INFO, logger="posttrain"):
        trainer = KTOTrainer(tiny_model_path, args=_args(tmp_path), train_dataset=paired)
    assert "train_dataset holds paired preference data: unpairing it" in caplog.text
    data = trainer.train_dataset
    assert data["label"] == [True, False, True, False]
    completions = [tokenizer.decode([t for t, m in zip(r["input_ids"], r["completion_mask"]) if m]) for r in data]
    assert completions == [" blue<|im_end|>", " red<|im_end|>", " good<|im_end|>", " bad<|im_end|>"]


def test_conversational_rows_train_on_the_assistant_reply(tmp_path, tiny_model_path, tokenizer):
    data = Dataset.from_list(
        [
            {
                "prompt": [{"role": "user", "content": "color?"}],
                "completion": [{"role": "assistant", "content": c}],
                "label": c == "blue",
            }
            for c in ("blue", "red")
        ]
    )
    row = KTOTrainer(tiny_model_path, args=_args(tmp_path), train_dataset=data).train_dataset[0]
    trained = [t for t, m in zip(row["input_ids"], row["completion_mask"]) if m]
    assert tokenizer.decode(trained) == "blue<|im_end|>\n"  # the whole rendered turn, as in TRL
    assert tokenizer.decode(row["input_ids"]).startswith("<|im_start|>user\ncolor?<|im_end|>")


def test_one_class_only_and_string_labels_are_errors(tmp_path, tiny_model_path):
    only_good = _unpaired(8).filter(lambda x: x["label"])
    with pytest.raises(
        DataError,
        match=r"KTO needs both desirable and undesirable examples, but train_dataset has "
        r"no undesirable \(label False\) rows \(4 desirable, 0 undesirable\)",
    ):
        KTOTrainer(tiny_model_path, args=_args(tmp_path), train_dataset=only_good)
    # Without a reference point, one class is a valid (if one-sided) objective.
    KTOTrainer(tiny_model_path, args=_args(tmp_path, loss_type="apo_zero_unpaired"), train_dataset=only_good)
    strings = _unpaired(4).map(lambda x: {"label": "good" if x["label"] else "bad"})
    with pytest.raises(
        DataError,
        match=r"Row 0, column 'label': expected a boolean \(True = desirable\), "
        r"got 'good' \(str\)",
    ):
        KTOTrainer(tiny_model_path, args=_args(tmp_path), train_dataset=strings)
    with pytest.raises(ConfigError, match="loss_type='sigmoid' is not supported"):
        _args(tmp_path, loss_type="sigmoid")


def test_class_imbalance_warning_suggests_weights(tmp_path, tiny_model_path, caplog):
    data = _unpaired(8).select([0, 1, 2, 4, 6])  # 4 desirable, 1 undesirable
    with caplog.at_level(logging.WARNING, logger="posttrain"):
        KTOTrainer(tiny_model_path, args=_args(tmp_path, undesirable_weight=2.0), train_dataset=data)
    # ratio = 1 * 4 / (2 * 1) = 2; desirable_weight in [2 * 1 / 4, 4/3 * 2 * 1 / 4] = [0.5, 0.667]
    assert "4 desirable and 1 undesirable" in caplog.text and "is 2, outside [1, 4/3]" in caplog.text
    assert "set desirable_weight between 0.5 and 0.667" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="posttrain"):
        KTOTrainer(
            tiny_model_path, args=_args(tmp_path, desirable_weight=0.6, undesirable_weight=2.0), train_dataset=data
        )
    assert "outside [1, 4/3]" not in caplog.text


def test_peft_reference_is_the_adapter_disabled_policy(tmp_path, tiny_model_path):
    from peft import LoraConfig

    trainer = KTOTrainer(
        tiny_model_path,
        args=_args(tmp_path, max_steps=4, learning_rate=2e-2, beta=1.0),
        train_dataset=_unpaired(8),
        peft_config=LoraConfig(r=4, target_modules=["q_proj", "v_proj"]),
    )
    assert trainer.ref_model is None
    base = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if not p.requires_grad}
    trainer.train()
    logs = [h for h in trainer.state.log_history if "loss" in h]
    assert logs[0]["loss"] == pytest.approx(0.5, abs=1e-5)  # LoRA starts as a no-op: policy = reference
    assert logs[-1]["rewards/margins"] > 0
    assert all(torch.equal(p, dict(trainer.model.named_parameters())[n]) for n, p in base.items())


def test_rows_whose_prompt_fills_max_length_are_dropped(tmp_path, tiny_model_path, caplog):
    data = Dataset.from_list(
        [{"prompt": "the cat is" + " very" * 20, "completion": " good", "label": True}]
        + [dict(row) for row in _unpaired(4)]
    )
    with caplog.at_level(logging.WARNING, logger="posttrain"):
        trainer = KTOTrainer(tiny_model_path, args=_args(tmp_path, max_length=16), train_dataset=data)
    assert len(trainer.train_dataset) == 4 and "Dropping 1 of 5 rows" in caplog.text
    assert all(1 in mask for mask in trainer.train_dataset["completion_mask"])
