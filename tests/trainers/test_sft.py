"""SFTTrainer end to end on the tiny model: learning, loss normalisation, chunked loss, LoRA, errors."""

import math

import pytest
import torch
from datasets import Dataset

from posttrain import SFTConfig, SFTTrainer
from posttrain.errors import ConfigError, DataError


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
    return SFTConfig(**base)


def _pc_data(n=16):
    rows = []
    for i in range(n):
        a, b = i % 5, (i * 3) % 5
        rows.append({"prompt": f"{a} plus {b} equals", "completion": f" {a + b}"})
    return Dataset.from_list(rows)


def _chat_data(n=16):
    return Dataset.from_list(
        [
            {"messages": [{"role": "user", "content": f"say {w}"}, {"role": "assistant", "content": w}]}
            for w in ["red", "green", "blue", "cat"] * (n // 4)
        ]
    )


def _grads(trainer):
    return {n: p.grad.clone() for n, p in trainer.model.named_parameters() if p.grad is not None}


def _one_step_params(tmp_path, tiny_model_path, data, **kw):
    trainer = SFTTrainer(
        tiny_model_path,
        args=_args(tmp_path, max_steps=1, learning_rate=1e-2, optim="sgd", lr_scheduler_type="constant", **kw),
        train_dataset=data,
    )
    trainer.train()
    return {n: p.detach().clone() for n, p in trainer.model.named_parameters()}


def test_loss_decreases_on_a_small_task(tmp_path, tiny_model_path):
    trainer = SFTTrainer(
        tiny_model_path,
        args=_args(tmp_path, max_steps=30, learning_rate=1e-2),
        train_dataset=_chat_data(),
    )
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert losses[-1] < 0.6 * losses[0]
    logged = trainer.state.log_history[0]
    for key in ("loss", "mean_token_accuracy", "num_tokens_trained", "learning_rate", "grad_norm"):
        assert key in logged


def test_batch_times_accumulation_equivalence(tmp_path, tiny_model_path):
    # Examples of different lengths make a per-micro-batch mean differ from the token mean.
    data = Dataset.from_list([{"prompt": "the", "completion": " cat is on the tree" * (1 + i % 3)} for i in range(8)])
    full = _one_step_params(tmp_path / "a", tiny_model_path, data, per_device_train_batch_size=8)
    split = _one_step_params(
        tmp_path / "b", tiny_model_path, data, per_device_train_batch_size=1, gradient_accumulation_steps=8
    )
    for name in full:
        torch.testing.assert_close(full[name], split[name], atol=1e-6, rtol=1e-5)


def test_padding_free_and_packing_give_the_padded_loss(tmp_path, tiny_model_path):
    data = _pc_data(8)
    padded = SFTTrainer(tiny_model_path, args=_args(tmp_path / "p", per_device_train_batch_size=8), train_dataset=data)
    free = SFTTrainer(
        tiny_model_path,
        args=_args(tmp_path / "f", per_device_train_batch_size=8, padding_free=True),
        train_dataset=data,
    )
    packed = SFTTrainer(
        tiny_model_path, args=_args(tmp_path / "k", per_device_train_batch_size=8, packing=True), train_dataset=data
    )
    losses = []
    for trainer in (padded, free, packed):
        batch = trainer.data_collator([trainer.train_dataset[i] for i in range(len(trainer.train_dataset))])
        trainer.model.eval()
        with torch.no_grad():
            losses.append(trainer.compute_loss(trainer.model, batch).item())
    assert len(packed.train_dataset) < 8
    assert losses[0] == pytest.approx(losses[1], abs=1e-5) and losses[0] == pytest.approx(losses[2], abs=1e-5)


def test_packed_layout_follows_the_attention_implementation(tmp_path, tiny_model_path):
    from transformers import AutoModelForCausalLM

    from posttrain.data.collators import LanguageModelingCollator

    data = _pc_data(8)
    packed = SFTTrainer(
        tiny_model_path, args=_args(tmp_path / "k", per_device_train_batch_size=8, packing=True), train_dataset=data
    )
    assert packed.model.config._attn_implementation == "sdpa" and packed.data_collator.one_row is False
    rows = [packed.train_dataset[i] for i in range(len(packed.train_dataset))]
    packed.model.eval()
    losses = []
    for one_row in (False, True):
        packed.data_collator.one_row = one_row
        batch = packed.data_collator(rows)
        assert batch["input_ids"].shape[0] == (1 if one_row else len(rows))
        with torch.no_grad():
            losses.append(packed.compute_loss(packed.model, batch).item())
    assert len(rows) > 1 and losses[0] == pytest.approx(losses[1], abs=1e-5)
    # Flash attention sees sequence boundaries only within one row (no flash kernel on CPU: the trainer
    # only reads the setting here, nothing runs).
    flash_model = AutoModelForCausalLM.from_pretrained(tiny_model_path)
    flash_model.config._attn_implementation = "flash_attention_2"
    flash = SFTTrainer(flash_model, args=_args(tmp_path / "f", packing=True), train_dataset=data)
    assert flash.data_collator.one_row is True
    # A collator the caller passes is left as it is.
    given = LanguageModelingCollator(0, padding_free=True)
    assert (
        SFTTrainer(
            tiny_model_path, args=_args(tmp_path / "g"), train_dataset=data, data_collator=given
        ).data_collator.one_row
        is True
    )


def test_chunked_loss_equals_full_logits_loss_and_gradients(tmp_path, tiny_model_path):
    data = _chat_data(8)
    results = []
    for chunked in (False, True):
        trainer = SFTTrainer(
            tiny_model_path,
            args=_args(tmp_path / str(chunked), chunked_loss=chunked, loss_chunk_size=7),
            train_dataset=data,
        )
        batch = trainer.data_collator([trainer.train_dataset[i] for i in range(8)])
        trainer.model.train()
        loss = trainer.compute_loss(trainer.model, batch)
        loss.backward()
        results.append((loss.detach(), _grads(trainer)))
    torch.testing.assert_close(results[0][0], results[1][0], atol=1e-6, rtol=1e-6)
    for name, grad in results[0][1].items():
        torch.testing.assert_close(grad, results[1][1][name], atol=1e-6, rtol=1e-5)


def test_loss_matches_hand_computed_mean_nll(tmp_path, tiny_model_path):
    trainer = SFTTrainer(tiny_model_path, args=_args(tmp_path), train_dataset=_pc_data(2))
    rows = [trainer.train_dataset[i] for i in range(2)]
    batch = trainer.data_collator(rows)
    trainer.model.eval()
    with torch.no_grad():
        loss = trainer.compute_loss(trainer.model, batch).item()
        total, count = 0.0, 0
        for row in rows:
            logits = trainer.model(input_ids=torch.tensor([row["input_ids"]])).logits[0].double()
            for t in range(1, len(row["input_ids"])):
                if row["labels"][t] != -100:
                    total -= torch.log_softmax(logits[t - 1], -1)[row["input_ids"][t]].item()
                    count += 1
    assert count > 0 and loss == pytest.approx(total / count, rel=1e-5)


def test_lora_train_save_reload_generate(tmp_path, tiny_model_path):
    from peft import AutoPeftModelForCausalLM, LoraConfig

    trainer = SFTTrainer(
        tiny_model_path,
        args=_args(tmp_path, max_steps=2),
        train_dataset=_chat_data(8),
        peft_config=LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]),
    )
    trainable = [n for n, p in trainer.model.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)
    trainer.train()
    trainer.save_model(str(tmp_path / "adapter"))
    reloaded = AutoPeftModelForCausalLM.from_pretrained(str(tmp_path / "adapter"))
    ids = torch.tensor([[5, 6, 7]])
    trainer.model.eval()
    with torch.no_grad():
        torch.testing.assert_close(reloaded(input_ids=ids).logits, trainer.model(input_ids=ids).logits)
    out = reloaded.generate(ids, max_new_tokens=3, do_sample=False)
    assert out.shape[1] >= 4


def test_errors_before_training(tmp_path, tiny_model_path, fresh_tokenizer):
    with pytest.raises(ConfigError, match="assistant_only_loss=True needs conversational data"):
        SFTTrainer(tiny_model_path, args=_args(tmp_path, assistant_only_loss=True), train_dataset=_pc_data(2))
    fresh_tokenizer.chat_template = None
    with pytest.raises(DataError, match="tokenizer has no chat template"):
        SFTTrainer(tiny_model_path, args=_args(tmp_path), train_dataset=_chat_data(4), processing_class=fresh_tokenizer)
    with pytest.raises(DataError, match="Row 1: all its trained tokens lie beyond max_length=4"):
        SFTTrainer(
            tiny_model_path,
            args=_args(tmp_path, max_length=4),
            train_dataset=Dataset.from_list(
                [{"prompt": "a", "completion": "b"}, {"prompt": "the cat is on the tree", "completion": " red"}]
            ),
        )


def test_a_tokenizer_without_eos_stops_before_training(tmp_path, tiny_model_path, fresh_tokenizer):
    """Without an EOS token no training sequence would end with one, and the model would never learn to stop:
    standard text is refused naming the fix (eos_token), conversations warn; eos_token= fixes it."""
    fresh_tokenizer.pad_token = "<|endoftext|>"
    fresh_tokenizer.eos_token = None
    with pytest.raises(ConfigError, match=r"no EOS token.*never learn to stop.*Set eos_token="):
        SFTTrainer(tiny_model_path, args=_args(tmp_path), train_dataset=_pc_data(2), processing_class=fresh_tokenizer)
    with pytest.warns(UserWarning, match=r"no EOS token.*Set eos_token="):
        SFTTrainer(tiny_model_path, args=_args(tmp_path), train_dataset=_chat_data(4), processing_class=fresh_tokenizer)
    trainer = SFTTrainer(
        tiny_model_path,
        args=_args(tmp_path, eos_token="<|im_end|>"),
        train_dataset=_pc_data(2),
        processing_class=fresh_tokenizer,
    )
    assert trainer.train_dataset[0]["input_ids"][-1] == fresh_tokenizer.convert_tokens_to_ids("<|im_end|>")


def test_missing_pad_token_is_set_and_announced(tmp_path, tiny_model_path, fresh_tokenizer, caplog):
    fresh_tokenizer.pad_token = None
    with caplog.at_level("WARNING", logger="posttrain"):
        trainer = SFTTrainer(
            tiny_model_path, args=_args(tmp_path), train_dataset=_pc_data(2), processing_class=fresh_tokenizer
        )
    assert trainer.processing_class.pad_token == "<|im_end|>"
    assert "no pad token" in caplog.text


def test_chunked_loss_refuses_an_adapted_output_layer(tmp_path, tiny_model_path):
    from peft import LoraConfig

    with pytest.raises(ConfigError, match="chunked_loss=True needs a plain linear output layer"):
        SFTTrainer(
            tiny_model_path,
            args=_args(tmp_path, chunked_loss=True),
            train_dataset=_pc_data(2),
            peft_config=LoraConfig(r=2, target_modules=["lm_head", "q_proj"]),
        )


def test_evaluation_without_eval_dataset_fails_before_training(tmp_path, tiny_model_path):
    with pytest.raises(ConfigError, match="eval_on_start=True: evaluation needs an eval_dataset"):
        SFTTrainer(tiny_model_path, args=_args(tmp_path, eval_on_start=True), train_dataset=_pc_data(2))


def test_the_model_is_tagged_with_its_method(tmp_path, tiny_model_path):
    """TRL's trainers tag the model for the Hub ("trl" and the method); posttrain adds its own name."""
    trainer = SFTTrainer(tiny_model_path, args=_args(tmp_path), train_dataset=_pc_data(2))
    assert {"posttrain", "trl", "sft"} <= set(trainer.model.model_tags)


def test_prompt_tuning_trains_only_the_virtual_tokens(tmp_path, tiny_model_path):
    """PEFT prompt learning prepends virtual tokens, so the logits are longer than the labels: their positions are
    dropped (and the chunked loss, which reads the decoder's output, is not used)."""
    from peft import PromptEncoderConfig, TaskType

    trainer = SFTTrainer(
        tiny_model_path,
        args=_args(tmp_path, max_steps=2, learning_rate=1e-2),
        train_dataset=_pc_data(8),
        peft_config=PromptEncoderConfig(task_type=TaskType.CAUSAL_LM, num_virtual_tokens=4, encoder_hidden_size=8),
    )
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    trainer.train()
    changed = {n for n, p in trainer.model.named_parameters() if not torch.equal(p, before[n])}
    assert changed and all("prompt_encoder" in n for n in changed)
    assert trainer.state.log_history[-1]["train_loss"] > 0


def test_the_training_summary_carries_the_last_windows_metrics(tmp_path, tiny_model_path):
    """TRL's `trainer.state.log_history[-1]` (the end-of-training summary) holds the last window's metrics; posttrain
    logs that window on the last step and repeats its metrics in the summary."""
    trainer = SFTTrainer(tiny_model_path, args=_args(tmp_path, max_steps=3, logging_steps=10), train_dataset=_pc_data())
    trainer.train()
    window, summary = trainer.state.log_history[-2:]
    assert "train_loss" in summary and summary["mean_token_accuracy"] == window["mean_token_accuracy"]
    assert summary["entropy"] == window["entropy"]
    # On TRL's schedule (the last step logged as usual) TRL's summary holds no window, and neither does posttrain's.
    trainer = SFTTrainer(
        tiny_model_path, args=_args(tmp_path / "on", max_steps=3, logging_steps=1), train_dataset=_pc_data()
    )
    trainer.train()
    assert len([row for row in trainer.state.log_history if "entropy" in row]) == 3
    assert "train_loss" in trainer.state.log_history[-1] and "entropy" not in trainer.state.log_history[-1]
    # Logging by epoch: the epoch's end logs its window on schedule, so the summary holds none either.
    args = _args(tmp_path / "epoch", max_steps=-1, num_train_epochs=1, logging_strategy="epoch")
    trainer = SFTTrainer(tiny_model_path, args=args, train_dataset=_pc_data())
    trainer.train()
    assert len([row for row in trainer.state.log_history if "entropy" in row]) == 1
    assert "train_loss" in trainer.state.log_history[-1] and "entropy" not in trainer.state.log_history[-1]


def test_moe_aux_loss_is_enabled_and_logged(tmp_path):
    """TRL's `trainer.aux_loss_enabled` and the logged `aux_loss` of a Mixture-of-Experts model (in the summary too)."""
    from posttrain.models.tiny import save_tiny_model

    moe = save_tiny_model(tmp_path / "moe", moe=True)
    trainer = SFTTrainer(moe, args=_args(tmp_path, max_steps=2, logging_steps=10), train_dataset=_pc_data(8))
    assert trainer.aux_loss_enabled
    trainer.train()
    assert trainer.state.log_history[-1]["aux_loss"] > 0


def test_sharegpt_conversations_column_trains_as_messages(tmp_path, tiny_model_path):
    # TRL reads a ShareGPT `conversations` column of from/value turns as `messages`.
    rows = _chat_data(4)
    sharegpt = rows.map(
        lambda r: {"conversations": [{"from": m["role"], "value": m["content"]} for m in r["messages"]]},
        remove_columns=["messages"],
    )
    ours = SFTTrainer(tiny_model_path, args=_args(tmp_path / "a"), train_dataset=sharegpt).train_dataset
    reference = SFTTrainer(tiny_model_path, args=_args(tmp_path / "b"), train_dataset=rows).train_dataset
    assert ours["input_ids"] == reference["input_ids"] and ours["labels"] == reference["labels"]
