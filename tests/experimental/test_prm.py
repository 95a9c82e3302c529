"""Process reward models (posttrain.experimental.prm): stepwise tokenization as TRL's PRMTrainer documents it, the
loss and scoring against float64 references, a tiny token classifier learning separable step labels, and a PRM
scoring GRPO's completions. TRL 1.16 dropped PRMTrainer, so there is no side-by-side check; its defaults and
signature (TRL 0.28) are written out here."""

import dataclasses
import inspect
import math
import random
from unittest import mock

import pytest
import torch
from datasets import Dataset
from transformers import LlamaForTokenClassification

from posttrain.errors import ConfigError, DataError
from posttrain.experimental.prm import PRMConfig, PRMTrainer, prm_reward_func, tokenize_steps
from posttrain.losses.prm import aggregate_steps, step_label_sums, step_probabilities
from posttrain.models.tiny import build_tiny_model


def _prm(tokenizer, seed=0):
    config = build_tiny_model(tokenizer, seed=seed).config
    config.num_labels = 2
    torch.manual_seed(seed)
    return LlamaForTokenClassification(config)


def _ids(tokenizer, text):
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def _kw(tmp_path, **kw):
    return {
        **dict(
            output_dir=str(tmp_path),
            per_device_train_batch_size=4,
            max_steps=2,
            report_to="none",
            save_strategy="no",
            use_cpu=True,
            bf16=False,
            disable_tqdm=True,
            seed=0,
        ),
        **kw,
    }


# -- tokenization ------------------------------------------------------------------------------------------------
def test_labels_sit_on_the_last_separator_token_of_each_step(fresh_tokenizer):
    tok = fresh_tokenizer
    tok.bos_token = "<|endoftext|>"
    row = {"prompt": "2 + 3 =", "completions": ["5 so", "then 9"], "labels": [True, False]}
    out = tokenize_steps(row, tok, " ;\n")
    step1, step2, sep = _ids(tok, "5 so"), _ids(tok, "then 9"), _ids(tok, " ;\n")
    prompt = [tok.bos_token_id] + _ids(tok, "2 + 3 =")
    assert out["input_ids"] == prompt + step1 + sep + step2 + sep
    expected = [-100] * (len(prompt) + len(step1) + len(sep) - 1) + [1] + [-100] * (len(step2) + len(sep) - 1) + [0]
    assert out["labels"] == expected

    last_only = tokenize_steps(row, tok, " ;\n", train_on_last_step_only=True)
    assert [x for x in last_only["labels"] if x != -100] == [0]
    assert tokenize_steps(row, tok, " ;\n", train_on_last_step_only=True, is_eval=True) == out  # eval: every step


def test_truncation(tokenizer):
    row = {"prompt": "cat dog bird fish sky", "completions": ["red green", "blue sun"], "labels": [False, True]}
    full = tokenize_steps(row, tokenizer, "\n")
    prompt = _ids(tokenizer, "cat dog bird fish sky")
    steps = full["input_ids"][len(prompt) :]
    cut = tokenize_steps(row, tokenizer, "\n", max_completion_length=3)
    assert cut["input_ids"] == prompt + steps[:3]
    assert tokenize_steps(row, tokenizer, "\n", max_length=4)["input_ids"] == full["input_ids"][:4]
    short = tokenize_steps(row, tokenizer, "\n", max_prompt_length=2)
    assert short["input_ids"] == prompt[-2:] + steps  # the prompt's end is kept
    assert short["labels"][2:] == full["labels"][len(prompt) :]


def test_bad_rows_are_named(tokenizer):
    with pytest.raises(DataError, match="one label"):
        tokenize_steps({"prompt": "a", "completions": ["b", "c"], "labels": [True]}, tokenizer, "\n", row=3)
    with pytest.raises(DataError, match="Row 1, column 'prompt'"):
        tokenize_steps(
            {"prompt": [{"role": "user", "content": "a"}], "completions": ["b"], "labels": [True]},
            tokenizer,
            "\n",
            row=1,
        )
    with pytest.raises(ConfigError, match="step_separator"):
        PRMConfig(output_dir="unused", use_cpu=True, step_separator="")


# -- loss and scoring against float64 references ------------------------------------------------------------------
def test_step_label_sums_match_a_float64_reference():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 7, 2, generator=g, dtype=torch.float64)
    labels = torch.full((3, 7), -100)
    labels[0, 2], labels[0, 6], labels[1, 3], labels[2, 0], labels[2, 5] = 1, 0, 1, 0, 1
    loss, correct, count = step_label_sums(logits, labels)
    ref_loss, ref_correct, ref_count = 0.0, 0, 0
    for b in range(3):
        for t in range(7):
            y = int(labels[b, t])
            if y == -100:
                continue
            a, c = float(logits[b, t, 0]), float(logits[b, t, 1])
            log_z = math.log(math.exp(a) + math.exp(c))
            ref_loss += log_z - (a, c)[y]
            ref_correct += int((c > a) == (y == 1))
            ref_count += 1
    assert loss.item() == pytest.approx(ref_loss, rel=1e-12)
    assert (int(correct), int(count)) == (ref_correct, ref_count)


def test_step_probabilities_and_aggregates():
    logits = torch.tensor([[0.3, -1.2], [2.0, 0.5], [-0.4, 0.9]], dtype=torch.float64)
    probs = step_probabilities(logits).tolist()
    ref = [math.exp(b) / (math.exp(a) + math.exp(b)) for a, b in logits.tolist()]
    assert probs == pytest.approx(ref, rel=1e-12)
    assert step_probabilities(torch.tensor([[0.7]])).item() == pytest.approx(1 / (1 + math.exp(-0.7)), rel=1e-6)
    assert aggregate_steps(ref, "min") == pytest.approx(min(ref))
    assert aggregate_steps(ref, "prod") == pytest.approx(ref[0] * ref[1] * ref[2])
    assert aggregate_steps(ref, "mean") == pytest.approx(sum(ref) / 3)
    assert aggregate_steps(ref, "last") == pytest.approx(ref[2])
    assert aggregate_steps([], "min") == 0.0
    with pytest.raises(ConfigError):
        aggregate_steps(ref, "max")


# -- TRL's surface ----------------------------------------------------------------------------------------------
def test_defaults_and_signature_are_trls():
    defaults = {f.name: f.default for f in dataclasses.fields(PRMConfig)}
    trl_028 = dict(
        learning_rate=1e-5,
        logging_steps=10,
        max_length=1024,
        max_prompt_length=512,
        max_completion_length=None,
        disable_dropout=True,
        step_separator="\n",
        train_on_last_step_only=False,
        dataset_num_proc=None,
    )
    assert {k: defaults[k] for k in trl_028} == trl_028
    params = list(inspect.signature(PRMTrainer.__init__).parameters)[1:13]
    assert params == [
        "model",
        "args",
        "data_collator",
        "train_dataset",
        "eval_dataset",
        "processing_class",
        "model_init",
        "compute_metrics",
        "callbacks",
        "optimizers",
        "preprocess_logits_for_metrics",
        "peft_config",
    ]


# -- learning ---------------------------------------------------------------------------------------------------
def _steps(n, seed=0):
    """A step is correct exactly when it mentions 'red' (wrong ones say 'blue')."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        labels = [rng.random() < 0.5 for _ in range(3)]
        steps = [
            f"{rng.choice(['cat', 'dog', 'sun'])} {rng.choice(['sky', 'tree'])} {'red' if ok else 'blue'}"
            for ok in labels
        ]
        rows.append({"prompt": "one two three", "completions": steps, "labels": labels})
    return Dataset.from_list(rows)


def test_a_tiny_token_classifier_learns_separable_step_labels(tmp_path, tokenizer):
    trainer = PRMTrainer(
        _prm(tokenizer),
        args=PRMConfig(
            **_kw(
                tmp_path,
                max_steps=20,
                learning_rate=5e-3,
                lr_scheduler_type="constant",
                logging_steps=1,
                per_device_train_batch_size=16,
            )
        ),
        train_dataset=_steps(64),
        eval_dataset=_steps(16, seed=1),
        processing_class=tokenizer,
    )
    before = trainer.evaluate()
    trainer.train()
    after = trainer.evaluate()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert len(losses) == 20
    assert after["eval_loss"] < 0.5 * before["eval_loss"], (before, after)
    assert after["eval_accuracy"] > 0.85 and before["eval_accuracy"] < 0.7
    assert losses[-1] < losses[0]
    assert [h["num_steps"] for h in trainer.state.log_history if "num_steps" in h][-1] == 20 * 16 * 3


def test_compute_metrics_gets_token_logits_and_labels(tmp_path, tokenizer):
    seen = {}

    def metrics(prediction):
        seen["shapes"] = prediction.predictions.shape, prediction.label_ids.shape
        return {"labelled": float((prediction.label_ids != -100).sum())}

    trainer = PRMTrainer(
        _prm(tokenizer),
        args=PRMConfig(**_kw(tmp_path)),
        train_dataset=_steps(4),
        eval_dataset=_steps(4),
        processing_class=tokenizer,
        compute_metrics=metrics,
    )
    out = trainer.evaluate()
    assert out["eval_labelled"] == 12 and seen["shapes"][0][-1] == 2


# -- a PRM as GRPO's reward -------------------------------------------------------------------------------------
def test_reward_function_scores_each_completion_alone(tokenizer):
    model = _prm(tokenizer, seed=3)
    reward = prm_reward_func(model, tokenizer, aggregate="min")
    prompts = ["cat dog", [{"role": "user", "content": "sun moon"}]]
    completions = ["red sky\nblue tree\n", [{"role": "assistant", "content": "one\n\ntwo three"}]]
    got = reward(prompts, completions)
    for prompt, steps, value in [
        ("cat dog", ["red sky", "blue tree"], got[0]),
        ("sun moon", ["one", "two three"], got[1]),
    ]:
        ids, ends = _ids(tokenizer, prompt), []
        for step in steps:
            ids += _ids(tokenizer, step) + _ids(tokenizer, "\n")
            ends.append(len(ids) - 1)
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([ids])).logits[0].double()
        p = [math.exp(logits[t, 1]) / (math.exp(logits[t, 0]) + math.exp(logits[t, 1])) for t in ends]
        assert value == pytest.approx(min(p), abs=1e-5)
        last = prm_reward_func(model, tokenizer, aggregate="last")([prompt], ["\n".join(steps)])[0]
        assert last == pytest.approx(p[-1], abs=1e-5)
    assert reward(["x"], ["\n \n"]) == [0.0]


def test_prm_rewards_grpo_for_two_steps(tmp_path, tokenizer, tiny_model_path):
    from posttrain.trainers.grpo import GRPOConfig, GRPOTrainer

    reward = prm_reward_func(_prm(tokenizer), tokenizer, step_separator=" ")
    data = Dataset.from_list([{"prompt": f"cat {i} dog"} for i in range(8)])
    trainer = GRPOTrainer(
        tiny_model_path,
        reward,
        train_dataset=data,
        args=GRPOConfig(
            **_kw(
                tmp_path,
                per_device_train_batch_size=4,
                num_generations=4,
                max_completion_length=6,
                logging_steps=1,
                learning_rate=1e-2,
            )
        ),
    )
    trainer.train()
    means = [h["rewards/prm_reward/mean"] for h in trainer.state.log_history if "rewards/prm_reward/mean" in h]
    assert len(means) == 2
    assert all(0.0 < m < 1.0 for m in means)


@pytest.mark.parametrize("family", ["llama", "qwen3", "mistral", "qwen3_moe"])  # (Gemma 3 has no token classifier)
def test_repacked_rows_give_the_padded_batchs_loss_and_gradients(tmp_path, tokenizer, family):
    """A right-padded batch of uneven step lists runs on fewer rows (`repacked_tokens`), on any family whose decoder
    is recognised: the loss, accuracy counts and every gradient of the padded forward, in float64."""
    from transformers import AutoModelForTokenClassification

    from posttrain.models import layouts

    config = build_tiny_model(tokenizer, family=family).config
    config.num_labels = 2
    torch.manual_seed(0)
    model = AutoModelForTokenClassification.from_config(config).double()
    if family == "qwen3_moe":
        model.set_experts_implementation("eager")  # (grouped_mm has no float64 kernel)
    rows = _steps(8)
    rows = rows.map(
        lambda row, i: {"completions": row["completions"][: 1 + i % 3], "labels": row["labels"][: 1 + i % 3]},
        with_indices=True,
    )
    trainer = PRMTrainer(model, args=PRMConfig(**_kw(tmp_path)), train_dataset=rows, processing_class=tokenizer)
    batch = trainer.data_collator([trainer.train_dataset[i] for i in range(8)])
    packed = layouts.repacked_tokens(model, {k: v for k, v in batch.items() if k != "labels"})
    assert packed is not None and packed[0]["input_ids"].shape[0] < batch["input_ids"].shape[0]
    results = []
    for layout in (lambda *args: None, layouts.repacked_tokens):  # the padded batch, then the repacked one
        model.zero_grad()
        with mock.patch("posttrain.experimental.prm.prm_trainer.repacked_tokens", layout):
            loss = trainer.compute_loss(model, dict(batch))
        loss.backward()
        results.append((loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}))
    (loss, grads), (packed_loss, packed_grads) = results
    torch.testing.assert_close(packed_loss, loss, rtol=0, atol=1e-12)
    assert grads.keys() == packed_grads.keys()
    for name, grad in grads.items():
        torch.testing.assert_close(packed_grads[name], grad, rtol=0, atol=1e-10)
