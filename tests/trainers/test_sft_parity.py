"""SFT options with TRL's names: each changes what it should; metrics against hand computations; TRL side by side."""

import importlib.util
import inspect

import pytest
import torch
from datasets import Dataset

from posttrain import SFTConfig, SFTTrainer
from posttrain.errors import ConfigError
from posttrain.losses.sft import IGNORE_INDEX
from posttrain.models.tiny import save_tiny_model

HAS_TRL = importlib.util.find_spec("trl") is not None


def _args(tmp_path, **kw):
    base = dict(
        output_dir=str(tmp_path / "out"),
        per_device_train_batch_size=4,
        max_steps=1,
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


def _text(n=4):
    return Dataset.from_list([{"text": "the cat is on the tree " * (1 + i % 3)} for i in range(n)])


def _pc(n=4):
    return Dataset.from_list([{"prompt": f"{i} plus {i} equals", "completion": f" {2 * i}"} for i in range(n)])


def test_constructor_takes_trls_keyword_arguments_in_trls_order():
    names = list(inspect.signature(SFTTrainer.__init__).parameters)[1:]
    assert names[:15] == [
        "model",
        "args",
        "data_collator",
        "train_dataset",
        "eval_dataset",
        "processing_class",
        "compute_loss_func",
        "compute_metrics",
        "callbacks",
        "optimizers",
        "optimizer_cls_and_kwargs",
        "preprocess_logits_for_metrics",
        "quantization_config",
        "peft_config",
        "formatting_func",
    ]


def test_eos_token_is_appended_and_mirrored_on_the_model(tmp_path, tiny_model_path, fresh_tokenizer):
    trainer = SFTTrainer(
        tiny_model_path,
        args=_args(tmp_path, eos_token="<|endoftext|>"),
        train_dataset=_text(2),
        processing_class=fresh_tokenizer,
    )
    new_eos = fresh_tokenizer.convert_tokens_to_ids("<|endoftext|>")
    assert new_eos != fresh_tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert all(row["input_ids"][-1] == new_eos for row in trainer.train_dataset)
    assert trainer.model.config.eos_token_id == new_eos
    assert new_eos in trainer.model.generation_config.eos_token_id


def test_pad_token_pads_the_batches(tmp_path, tiny_model_path, fresh_tokenizer):
    trainer = SFTTrainer(
        tiny_model_path,
        args=_args(tmp_path, pad_token="<|im_start|>"),
        train_dataset=_text(2),
        processing_class=fresh_tokenizer,
    )
    pad = fresh_tokenizer.convert_tokens_to_ids("<|im_start|>")
    batch = trainer.data_collator([trainer.train_dataset[0], trainer.train_dataset[1]])
    short = int(batch["attention_mask"].sum(1).argmin())
    assert batch["input_ids"][short, -1] == pad and trainer.model.config.pad_token_id == pad


def test_tokens_outside_the_vocabulary_and_missing_templates_are_refused(tmp_path, tiny_model_path):
    for option in ("eos_token", "pad_token"):
        with pytest.raises(ConfigError, match=f"{option}='<nope>' is not a token of the tokenizer's vocabulary"):
            SFTTrainer(tiny_model_path, args=_args(tmp_path, **{option: "<nope>"}), train_dataset=_text(2))
    with pytest.raises(ConfigError, match="no such file"):
        SFTTrainer(
            tiny_model_path,
            args=_args(tmp_path, chat_template_path=str(tmp_path / "missing.jinja")),
            train_dataset=_text(2),
        )


def test_chat_template_path_reads_a_jinja_file(tmp_path, tiny_model_path):
    path = tmp_path / "t.jinja"
    path.write_text("{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}")
    data = Dataset.from_list(
        [{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yes"}]}]
    )
    trainer = SFTTrainer(tiny_model_path, args=_args(tmp_path, chat_template_path=str(path)), train_dataset=data)
    assert trainer.processing_class.decode(trainer.train_dataset[0]["input_ids"]) == "[user] hi\n[assistant] yes\n"


def test_chat_template_path_clones_a_tokenizer(tmp_path, tiny_model_path):
    from posttrain.models.tiny import build_tiny_tokenizer

    source = build_tiny_tokenizer()
    source.add_special_tokens({"additional_special_tokens": ["<|turn_end|>"]})
    source.eos_token = "<|turn_end|>"
    source.chat_template = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}<|turn_end|>{% endfor %}"
    source.save_pretrained(tmp_path / "source")
    data = Dataset.from_list(
        [{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "no"}]}]
    )
    trainer = SFTTrainer(
        tiny_model_path, args=_args(tmp_path, chat_template_path=str(tmp_path / "source")), train_dataset=data
    )
    tok = trainer.processing_class
    assert tok.eos_token == "<|turn_end|>"
    assert tok.decode(trainer.train_dataset[0]["input_ids"]).endswith("no<|turn_end|>")
    rows = trainer.model.get_input_embeddings().num_embeddings
    assert rows % 64 == 0 and rows == len(tok) and tok.eos_token_id < rows
    assert trainer.model.config.eos_token_id == tok.eos_token_id


def test_truncation_mode_keep_end_keeps_the_end(tmp_path, tiny_model_path, tokenizer):
    data = Dataset.from_list([{"text": "one two three four five six seven eight nine ten"}])
    full = tokenizer("one two three four five six seven eight nine ten")["input_ids"] + [tokenizer.eos_token_id]
    for mode, expected in (("keep_start", full[:5]), ("keep_end", full[-5:])):
        trainer = SFTTrainer(
            tiny_model_path, args=_args(tmp_path, max_length=5, truncation_mode=mode), train_dataset=data
        )
        assert trainer.train_dataset[0]["input_ids"] == expected
    with pytest.raises(ConfigError, match="truncation_mode='middle'"):
        _args(tmp_path, truncation_mode="middle")


def test_dataset_text_field_and_formatting_func_with_other_columns(tmp_path, tiny_model_path, tokenizer):
    data = Dataset.from_list([{"content": "red sky", "q": "what is two", "a": "two", "id": i} for i in range(2)])
    trainer = SFTTrainer(tiny_model_path, args=_args(tmp_path, dataset_text_field="content"), train_dataset=data)
    assert trainer.train_dataset[0]["input_ids"] == tokenizer("red sky")["input_ids"] + [tokenizer.eos_token_id]
    trainer = SFTTrainer(
        tiny_model_path,
        args=_args(tmp_path),
        train_dataset=data,
        formatting_func=lambda ex: f"Q: {ex['q']} A: {ex['a']}",
    )
    expected = tokenizer("Q: what is two A: two")["input_ids"] + [tokenizer.eos_token_id]
    assert trainer.train_dataset.column_names == ["input_ids", "labels"]  # TRL's prepared layout
    assert trainer.train_dataset[1]["input_ids"] == expected == trainer.train_dataset[1]["labels"]
    trainer.train()
    with pytest.raises(ConfigError, match="formatting_func turns each example into plain text"):
        SFTTrainer(tiny_model_path, args=_args(tmp_path), train_dataset=_pc(), formatting_func=lambda ex: ex["prompt"])
    with pytest.raises(ConfigError, match="dataset_text_field='body' is not a column"):
        SFTTrainer(tiny_model_path, args=_args(tmp_path, dataset_text_field="body"), train_dataset=data)


def test_pretokenized_rows_and_skip_prepare_dataset(tmp_path, tiny_model_path):
    rows = [{"input_ids": [5, 6, 7, 8, 9], "completion_mask": [0, 0, 1, 1, 1], "extra": "x"}]
    trainer = SFTTrainer(
        tiny_model_path,
        args=_args(tmp_path, completion_only_loss=True, max_length=4),
        train_dataset=Dataset.from_list(rows),
    )
    assert trainer.train_dataset[0] == {"input_ids": [5, 6, 7, 8], "labels": [IGNORE_INDEX, IGNORE_INDEX, 7, 8]}
    # As TRL: completion_mask only counts with completion-only loss, off by default without prompt/completion.
    trainer = SFTTrainer(tiny_model_path, args=_args(tmp_path), train_dataset=Dataset.from_list(rows))
    assert trainer.train_dataset[0]["labels"] == [5, 6, 7, 8, 9]
    given = Dataset.from_list([{"input_ids": [5, 6, 7], "labels": [IGNORE_INDEX, 6, 7]}] * 4)
    trainer = SFTTrainer(
        tiny_model_path, args=_args(tmp_path, dataset_kwargs={"skip_prepare_dataset": True}), train_dataset=given
    )
    assert trainer.train_dataset is given
    assert trainer.data_collator([given[0]])["labels"].tolist() == [[IGNORE_INDEX, 6, 7]]
    trainer.train()
    with pytest.raises(ConfigError, match="dataset_kwargs has unknown keys"):
        _args(tmp_path, dataset_kwargs={"skip": True})


def test_shuffle_eval_packing_and_pad_to_multiple_of(tmp_path, tiny_model_path):
    data = _text(8)
    plain = SFTTrainer(tiny_model_path, args=_args(tmp_path), train_dataset=data)
    shuffled = SFTTrainer(tiny_model_path, args=_args(tmp_path, shuffle_dataset=True), train_dataset=data)
    assert shuffled.train_dataset["input_ids"] == plain.train_dataset.shuffle(seed=0)["input_ids"]
    assert shuffled.train_dataset["input_ids"] != plain.train_dataset["input_ids"]
    packed = SFTTrainer(
        tiny_model_path, args=_args(tmp_path, packing=True, eval_packing=False), train_dataset=data, eval_dataset=data
    )
    assert "seq_lengths" in packed.train_dataset.column_names and len(packed.eval_dataset) == 8
    assert SFTConfig(output_dir=str(tmp_path)).pad_to_multiple_of is None  # 'auto' off Neuron
    padded = SFTTrainer(tiny_model_path, args=_args(tmp_path, pad_to_multiple_of=16), train_dataset=data)
    assert padded.data_collator([data_row for data_row in padded.train_dataset])["input_ids"].shape[1] % 16 == 0


def _hand_metrics(model, rows, loss_type="nll"):
    """Loss (mean over trained tokens), accuracy and entropy (means over trained tokens) from per-row float64
    log-probabilities, and the number of input tokens."""
    loss = correct = entropy = count = 0.0
    model.eval()
    with torch.no_grad():
        for row in rows:
            ids = row["input_ids"]
            logp = torch.log_softmax(model(input_ids=torch.tensor([ids])).logits[0].double(), -1)
            for t in range(1, len(ids)):
                if row["labels"][t] != -100:
                    lp = logp[t - 1, ids[t]]
                    loss += float(-lp * lp.exp()) if loss_type == "dft" else float(-lp)
                    correct += int(logp[t - 1].argmax() == ids[t])
                    entropy += float(-(logp[t - 1].exp() * logp[t - 1]).sum())
                    count += 1
    return loss / count, correct / count, entropy / count, sum(len(r["input_ids"]) for r in rows)


@pytest.mark.parametrize(
    "loss_type,layout",
    [("nll", {}), ("dft", {}), ("nll", {"padding_free": True}), ("dft", {"chunked_loss": True, "loss_chunk_size": 5})],
)
def test_logged_loss_and_metrics_match_hand_computation(tmp_path, tiny_model_path, loss_type, layout):
    data = _pc(4).map(lambda ex, i: {"completion": ex["completion"] + " and more" * i}, with_indices=True)
    trainer = SFTTrainer(
        tiny_model_path, args=_args(tmp_path, loss_type=loss_type, learning_rate=0.0, **layout), train_dataset=data
    )
    loss, accuracy, entropy, tokens = _hand_metrics(trainer.model, list(trainer.train_dataset), loss_type)
    trainer.train()
    logged = trainer.state.log_history[0]
    assert logged["loss"] == pytest.approx(loss, rel=1e-5)
    assert logged["mean_token_accuracy"] == pytest.approx(accuracy, abs=1e-9)
    assert logged["entropy"] == pytest.approx(entropy, rel=1e-5)
    assert logged["num_tokens"] == tokens  # all input tokens, padding excluded
    assert logged["num_tokens_trained"] == sum(sum(t != -100 for t in r["labels"][1:]) for r in trainer.train_dataset)


def test_compute_loss_func_replaces_the_loss_and_compute_metrics_gets_logits(tmp_path, tiny_model_path):
    seen = {}

    def double_nll(outputs, labels, num_items_in_batch=None):
        logits = outputs.logits[:, :-1].flatten(0, 1)
        nll = torch.nn.functional.cross_entropy(
            logits, labels[:, 1:].flatten(), ignore_index=IGNORE_INDEX, reduction="sum"
        )
        return 2 * nll / (num_items_in_batch if num_items_in_batch is not None else (labels[:, 1:] != -100).sum())

    def metrics(prediction):
        seen["shape"] = prediction.predictions.shape
        return {"seen": 1.0}

    args = dict(learning_rate=0.0, eval_strategy="steps", eval_steps=1, per_device_eval_batch_size=4)
    plain = SFTTrainer(tiny_model_path, args=_args(tmp_path / "a", **args), train_dataset=_pc(), eval_dataset=_pc())
    custom = SFTTrainer(
        tiny_model_path,
        args=_args(tmp_path / "b", **args),
        train_dataset=_pc(),
        eval_dataset=_pc(),
        compute_loss_func=double_nll,
        compute_metrics=metrics,
    )
    plain.train()
    custom.train()
    assert custom.state.log_history[0]["loss"] == pytest.approx(2 * plain.state.log_history[0]["loss"], rel=1e-5)
    evaluation = [h for h in custom.state.log_history if "eval_seen" in h][0]
    assert seen["shape"][0] == 4 and seen["shape"][-1] == len(custom.processing_class)
    assert evaluation["eval_loss"] == pytest.approx(
        2 * [h for h in plain.state.log_history if "eval_loss" in h][0]["eval_loss"], rel=1e-5
    )
    assert "eval_entropy" in evaluation and "eval_num_tokens" in evaluation
    with pytest.raises(ConfigError, match="compute_loss_func replaces the loss"):
        SFTTrainer(
            tiny_model_path, args=_args(tmp_path, loss_type="dft"), train_dataset=_pc(), compute_loss_func=double_nll
        )


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_router_aux_loss_is_added_with_its_coefficient(tmp_path, tiny_model_path, tokenizer, family):
    path = save_tiny_model(tmp_path / "moe", family=family, router_aux_loss_coef=0.01)
    for coef in (None, 0.5):
        trainer = SFTTrainer(path, args=_args(tmp_path, router_aux_loss_coef=coef), train_dataset=_text(4))
        batch = trainer.data_collator(list(trainer.train_dataset))
        trainer.model.eval()
        with torch.no_grad():
            loss = trainer.compute_loss(trainer.model, dict(batch))
            reference = trainer.model(**{k: v for k, v in batch.items() if k != "labels"}, output_router_logits=True)
        weight = 0.01 if coef is None else 0.5
        assert trainer.model.config.router_aux_loss_coef == weight
        nll = torch.nn.functional.cross_entropy(
            reference.logits[:, :-1].flatten(0, 1), batch["labels"][:, 1:].flatten(), ignore_index=IGNORE_INDEX
        )
        torch.testing.assert_close(loss, nll + weight * reference.aux_loss)
        assert reference.aux_loss > 0 and trainer._metrics["eval"]["aux_loss"] == [
            pytest.approx(reference.aux_loss.item())
        ]
    off = SFTTrainer(path, args=_args(tmp_path, router_aux_loss_coef=0.0), train_dataset=_text(4))
    assert off.model.config.output_router_logits is False
    with pytest.raises(ConfigError, match="router_aux_loss_coef=0.5 weights the load-balancing loss"):
        SFTTrainer(tiny_model_path, args=_args(tmp_path, router_aux_loss_coef=0.5), train_dataset=_text(2))


@pytest.mark.skipif(not HAS_TRL, reason="trl is not installed")
@pytest.mark.parametrize("loss_type", ["nll", "dft"])
def test_first_logged_metrics_equal_trls(tmp_path, tiny_model_path, loss_type):
    import trl
    from transformers import AutoModelForCausalLM, AutoTokenizer

    data = _text(4)
    common = dict(
        per_device_train_batch_size=4,
        max_steps=1,
        learning_rate=1e-3,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        use_cpu=True,
        seed=0,
        max_length=64,
        disable_tqdm=True,
        bf16=False,
        gradient_checkpointing=False,
        loss_type=loss_type,
    )
    logs = []
    for name, config, trainer_cls in (("trl", trl.SFTConfig, trl.SFTTrainer), ("posttrain", SFTConfig, SFTTrainer)):
        trainer = trainer_cls(
            AutoModelForCausalLM.from_pretrained(tiny_model_path),
            args=config(output_dir=str(tmp_path / name), **common),
            train_dataset=data,
            processing_class=AutoTokenizer.from_pretrained(tiny_model_path),
        )
        trainer.train()
        logs.append(trainer.state.log_history[0])
    ours, theirs = logs[1], logs[0]
    for key in ("loss", "mean_token_accuracy", "entropy"):
        assert ours[key] == pytest.approx(theirs[key], abs=1e-5), key
    assert ours["num_tokens"] == theirs["num_tokens"]
