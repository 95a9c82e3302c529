"""RewardTrainer on the tiny model: learning a held-out-separable preference, the Bradley-Terry loss against
a float64 reference, accumulation equivalence, save/reload, errors."""

import random

import pytest
import torch
import torch.nn.functional as F
from datasets import Dataset
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

from posttrain import RewardConfig, RewardTrainer
from posttrain.errors import ConfigError, DataError

FILLERS = "the a cat dog bird fish sky sun moon tree red green blue one two three".split()


def _args(tmp_path, **kw):
    base = dict(
        output_dir=str(tmp_path / "out"),
        per_device_train_batch_size=8,
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
    return RewardConfig(**base)


def _good_bad_pairs(n, seed):
    """The chosen text holds 'good' and the rejected one 'bad', among random filler words at random places."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        words = rng.sample(FILLERS, rng.randint(2, 4))
        at = rng.randint(0, len(words))
        chosen, rejected = (" ".join(words[:at] + [w] + words[at:]) for w in ("good", "bad"))
        rows.append({"prompt": f"{rng.choice(FILLERS)} is", "chosen": " " + chosen, "rejected": " " + rejected})
    return Dataset.from_list(rows)


def _unequal_pairs():
    """Pairs of different lengths, with a margin column."""
    return Dataset.from_list(
        [
            {
                "prompt": "the sky is",
                "chosen": " blue" * (1 + i % 3),
                "rejected": " red green" * (1 + i % 2),
                "margin": 0.5 * i,
            }
            for i in range(8)
        ]
    )


def _scores_alone(model, rows):
    """Float64 rewards of each sequence scored alone (no padding): the last token's score-head output."""
    scores = []
    for row in rows:
        for column in ("chosen_ids", "rejected_ids"):
            ids = torch.tensor([row["prompt_ids"] + row[column]])
            hidden = model.model(input_ids=ids).last_hidden_state[0, -1].double()
            scores.append(hidden @ model.score.weight[0].double())
    return torch.stack(scores).view(-1, 2)


def test_learns_a_held_out_separable_preference(tmp_path, tiny_model_path):
    trainer = RewardTrainer(
        tiny_model_path,
        args=_args(tmp_path, max_steps=20, learning_rate=5e-3),
        train_dataset=_good_bad_pairs(160, seed=0),
        eval_dataset=_good_bad_pairs(64, seed=1),
    )
    before = trainer.evaluate()["eval_accuracy"]
    trainer.train()
    after = trainer.evaluate()
    assert before < 0.5 and after["eval_accuracy"] >= 0.9
    logged = trainer.state.log_history[0]
    for key in ("loss", "accuracy", "margin", "grad_norm"):
        assert key in logged


def test_loss_matches_float64_bradley_terry_with_margin_and_centering(tmp_path, tiny_model_path):
    data = _unequal_pairs()
    trainer = RewardTrainer(tiny_model_path, args=_args(tmp_path, center_rewards_coefficient=0.3), train_dataset=data)
    rows = [trainer.train_dataset[i] for i in range(len(data))]
    batch = trainer.data_collator(rows)
    model = trainer.model.eval()
    with torch.no_grad():
        torch.nn.init.normal_(model.score.weight, std=0.5)  # rewards far enough apart for the terms to matter
        loss = trainer.compute_loss(model, batch).item()
        without_margin = trainer.compute_loss(model, {k: v for k, v in batch.items() if k != "margin"}).item()
        scores = _scores_alone(model, rows)
    chosen, rejected = scores[:, 0], scores[:, 1]
    margin = torch.tensor(data["margin"], dtype=torch.float64)
    centering = 0.3 * ((chosen + rejected) ** 2).mean()
    assert loss == pytest.approx((-F.logsigmoid(chosen - rejected - margin).mean() + centering).item(), rel=1e-5)
    assert without_margin == pytest.approx((-F.logsigmoid(chosen - rejected).mean() + centering).item(), rel=1e-5)
    # A positive margin asks for a larger gap, so the same rewards lose more.
    assert loss > without_margin


def _one_step_params(tmp_path, tiny_model_path, data, **kw):
    """Parameters before and after one SGD step."""
    trainer = RewardTrainer(
        tiny_model_path,
        args=_args(tmp_path, max_steps=1, learning_rate=1e-1, optim="sgd", lr_scheduler_type="constant", **kw),
        train_dataset=data,
    )
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    trainer.train()
    return before, {n: p.detach().clone() for n, p in trainer.model.named_parameters()}


def test_batch_times_accumulation_equivalence(tmp_path, tiny_model_path):
    data = _unequal_pairs()
    start, full = _one_step_params(tmp_path / "a", tiny_model_path, data, per_device_train_batch_size=8)
    same_start, split = _one_step_params(
        tmp_path / "b", tiny_model_path, data, per_device_train_batch_size=3, gradient_accumulation_steps=3
    )  # micro-batches of 3, 3 and 2 pairs
    assert torch.equal(start["score.weight"], same_start["score.weight"])  # the new head follows args.seed
    assert not torch.equal(full["score.weight"], start["score.weight"])
    for name in full:
        torch.testing.assert_close(full[name], split[name], atol=1e-6, rtol=1e-5)


def test_conversational_and_implicit_prompt_data(tmp_path, tiny_model_path, tokenizer):
    conversational = Dataset.from_list(
        [
            {
                "prompt": [{"role": "user", "content": "color?"}],
                "chosen": [{"role": "assistant", "content": "blue"}],
                "rejected": [{"role": "assistant", "content": "the red cat"}],
            }
        ]
        * 2
    )
    implicit = Dataset.from_list([{"chosen": "the sky is blue", "rejected": "the sky is red"}] * 2)
    conv = RewardTrainer(tiny_model_path, args=_args(tmp_path), train_dataset=conversational).train_dataset[0]
    assert tokenizer.decode(conv["prompt_ids"]).endswith("<|im_start|>assistant\n")
    assert tokenizer.decode(conv["chosen_ids"]) == "blue<|im_end|>\n"  # the whole rendered turn, as in TRL
    row = RewardTrainer(tiny_model_path, args=_args(tmp_path), train_dataset=implicit).train_dataset[0]
    assert tokenizer.decode(row["prompt_ids"]) == "the sky is "
    assert tokenizer.decode(row["rejected_ids"]) == "red<|im_end|>"


def test_saved_model_reloads_as_a_classifier_with_the_same_scores(tmp_path, tiny_model_path):
    trainer = RewardTrainer(tiny_model_path, args=_args(tmp_path, max_steps=2), train_dataset=_unequal_pairs())
    trainer.train()
    trainer.save_model(str(tmp_path / "rm"))
    reloaded = AutoModelForSequenceClassification.from_pretrained(str(tmp_path / "rm")).eval()
    assert reloaded.config.num_labels == 1 and reloaded.config.pad_token_id == trainer.processing_class.pad_token_id
    batch = trainer.data_collator([trainer.train_dataset[i] for i in range(4)])  # right-padded rows
    trainer.model.eval()
    with torch.no_grad():
        expected = trainer.model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        got = reloaded(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-6)


def test_lora_reward_model_trains_its_score_head(tmp_path, tiny_model_path):
    from peft import LoraConfig

    # As TRL: task_type=None trains the backbone's adapter only (said in a warning); another task type is refused.
    with pytest.warns(UserWarning, match=r"task_type is None.*score head stays as it was loaded"):
        trainer = RewardTrainer(
            tiny_model_path,
            args=_args(tmp_path, max_steps=1),
            train_dataset=_unequal_pairs(),
            peft_config=LoraConfig(r=4, target_modules=["q_proj"]),
        )
    assert not any(p.requires_grad for n, p in trainer.model.named_parameters() if "score" in n)
    with pytest.raises(ConfigError, match="task_type='SEQ_CLS'"):
        RewardTrainer(
            tiny_model_path,
            args=_args(tmp_path),
            train_dataset=_unequal_pairs(),
            peft_config=LoraConfig(r=4, target_modules=["q_proj"], task_type="CAUSAL_LM"),
        )
    trainer = RewardTrainer(
        tiny_model_path,
        args=_args(tmp_path, max_steps=1),
        train_dataset=_unequal_pairs(),
        peft_config=LoraConfig(r=4, target_modules=["q_proj"], task_type="SEQ_CLS"),
    )
    head = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if "score" in n and p.requires_grad}
    trainer.train()
    assert head and all(not torch.equal(p, dict(trainer.model.named_parameters())[n]) for n, p in head.items())


def test_num_labels_other_than_one_is_an_error(tmp_path, tiny_model_path, tokenizer):
    two = AutoModelForSequenceClassification.from_pretrained(tiny_model_path, num_labels=2)
    with pytest.raises(ConfigError, match="num_labels=2"):
        RewardTrainer(two, args=_args(tmp_path), train_dataset=_unequal_pairs())
    two.save_pretrained(tmp_path / "two")
    with pytest.raises(ConfigError, match="num_labels=2"):
        RewardTrainer(
            str(tmp_path / "two"), args=_args(tmp_path), train_dataset=_unequal_pairs(), processing_class=tokenizer
        )
    with pytest.raises(ConfigError, match="not a sequence classifier"):
        RewardTrainer(
            AutoModelForCausalLM.from_pretrained(tiny_model_path), args=_args(tmp_path), train_dataset=_unequal_pairs()
        )


def test_data_errors(tmp_path, tiny_model_path):
    with pytest.raises(DataError, match="RewardTrainer: train_dataset is empty"):
        RewardTrainer(tiny_model_path, args=_args(tmp_path), train_dataset=_unequal_pairs().select([]))
    with pytest.raises(DataError, match=r"RewardTrainer does not train on prompt-completion data"):
        RewardTrainer(
            tiny_model_path, args=_args(tmp_path), train_dataset=Dataset.from_list([{"prompt": "a", "completion": "b"}])
        )
    with pytest.raises(DataError, match="No known dataset format matches the columns \\['chosen'\\]"):
        RewardTrainer(tiny_model_path, args=_args(tmp_path), train_dataset=Dataset.from_list([{"chosen": "a"}]))
    with pytest.raises(DataError, match="Row 1, column 'rejected': expected a string, got NoneType"):
        rows = [{"chosen": "a", "rejected": "b"}, {"chosen": "a", "rejected": None}]
        RewardTrainer(
            tiny_model_path, args=_args(tmp_path), train_dataset=_unequal_pairs(), eval_dataset=Dataset.from_list(rows)
        )
    with pytest.raises(DataError, match="`train_dataset` is required"):  # TRL's words
        RewardTrainer(tiny_model_path, args=_args(tmp_path))


def test_pretokenized_pairs_and_a_peft_model_as_trl_takes_them(tmp_path, tiny_model_path, tokenizer):
    """TRL's tokenized reward rows (`chosen_ids` / `rejected_ids`, the old `*_input_ids` names with a FutureWarning)
    become prompt_ids + completions (their shared first tokens are the prompt); a PEFT-wrapped classifier is taken."""
    from peft import LoraConfig, get_peft_model

    rows = [
        {"chosen_ids": tokenizer(f"say {w} yes")["input_ids"], "rejected_ids": tokenizer(f"say {w} no")["input_ids"]}
        for w in ("red", "blue", "cat", "dog")
    ]
    trainer = RewardTrainer(tiny_model_path, args=_args(tmp_path, max_steps=1), train_dataset=Dataset.from_list(rows))
    first = trainer.train_dataset[0]
    assert first["prompt_ids"] + first["chosen_ids"] == rows[0]["chosen_ids"]
    assert first["prompt_ids"] + first["rejected_ids"] == rows[0]["rejected_ids"]
    old = Dataset.from_list(rows).rename_columns(
        {"chosen_ids": "chosen_input_ids", "rejected_ids": "rejected_input_ids"}
    )
    with pytest.warns(FutureWarning, match="will not be supported in v1"):
        RewardTrainer(tiny_model_path, args=_args(tmp_path), train_dataset=old)
    classifier = AutoModelForSequenceClassification.from_pretrained(tiny_model_path, num_labels=1)
    peft_model = get_peft_model(classifier, LoraConfig(r=2, target_modules=["q_proj"], task_type="SEQ_CLS"))
    RewardTrainer(peft_model, args=_args(tmp_path, max_steps=1), train_dataset=_unequal_pairs()).train()
