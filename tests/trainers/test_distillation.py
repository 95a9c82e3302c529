"""DistillationTrainer end to end on tiny models: learning from a teacher, the loss against a float64
reference (alpha mixing, completion tokens only), accumulation equivalence, vocabulary checks, errors."""

import random

import pytest
import torch
from datasets import Dataset

from posttrain import DistillationConfig, DistillationTrainer
from posttrain.errors import ConfigError
from posttrain.models.tiny import build_tiny_model, build_tiny_tokenizer

WORDS = "red green blue cat dog bird fish sky sun moon tree one two three".split()


def _args(tmp_path, config=DistillationConfig, **kw):
    base = dict(
        output_dir=str(tmp_path / "out"),
        per_device_train_batch_size=8,
        max_steps=3,
        learning_rate=1e-2,
        logging_steps=5,
        save_strategy="no",
        report_to="none",
        use_cpu=True,
        bf16=False,
        seed=0,
        max_length=64,
        disable_tqdm=True,
        lmbda=0.0,
    )  # offline unless a test says otherwise (TRL's default is lmbda=1)
    base.update(kw)
    return config(**base)


def _data(n, seed):
    """Prompt-completion rows of random words; completions of different lengths."""
    rng = random.Random(seed)
    return Dataset.from_list(
        [
            {"prompt": " ".join(rng.choices(WORDS, k=3)), "completion": " " + " ".join(rng.choices(WORDS, k=1 + i % 4))}
            for i in range(n)
        ]
    )


def _teacher(tokenizer, vocab_size=None):
    """A bigger random Llama with a sharpened (untied) output layer: peaked, context-dependent distributions."""
    teacher = build_tiny_model(tokenizer, seed=1, hidden_size=64, tie=False)
    if vocab_size is not None:
        teacher.resize_token_embeddings(vocab_size, mean_resizing=False)
    with torch.no_grad():
        teacher.lm_head.weight.mul_(5.0)
    return teacher


@pytest.fixture(scope="module")
def teacher_path(tmp_path_factory, tokenizer):
    path = tmp_path_factory.mktemp("teacher") / "model"
    _teacher(tokenizer).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


def _batch(trainer, n):
    return trainer.data_collator([trainer.train_dataset[i] for i in range(n)])


def _eval_loss(trainer, batch):
    trainer.model.eval()
    with torch.no_grad():
        return trainer.compute_loss(trainer.model, batch).item()


def test_student_learns_the_teacher_on_held_out_data(tmp_path, tiny_model_path, teacher_path):
    trainer = DistillationTrainer(
        tiny_model_path,
        teacher_path,
        args=_args(tmp_path, max_steps=30, beta=0.5),
        train_dataset=_data(64, 0),
        eval_dataset=_data(16, 1),
    )
    teacher_before = {n: p.clone() for n, p in trainer.teacher_model.named_parameters()}
    before = trainer.evaluate()
    trainer.train()
    after = trainer.evaluate()
    assert after["eval_distill_loss"] < 0.5 * before["eval_distill_loss"]
    assert after["eval_teacher_agreement"] > before["eval_teacher_agreement"] + 0.2
    logged = trainer.state.log_history[0]
    for key in ("loss", "distill_loss", "nll", "teacher_agreement", "mean_token_accuracy", "num_tokens_trained"):
        assert key in logged
    assert not trainer.teacher_model.training
    for name, param in trainer.teacher_model.named_parameters():
        assert not param.requires_grad and torch.equal(param, teacher_before[name])


def _reference(student, teacher, rows, alpha, beta, temperature):
    """Mean over completion tokens of alpha * JSD_beta + (1 - alpha) * NLL, row by row in float64, plus the
    mean JSD, mean NLL and top-1 agreement."""
    jsd_total = nll_total = agree = count = 0.0
    for row in rows:
        ids = torch.tensor([row["input_ids"]])
        s_logits, t_logits = student(input_ids=ids).logits[0].double(), teacher(input_ids=ids).logits[0].double()
        for t in range(1, len(row["input_ids"])):
            if row["labels"][t] == -100:
                continue
            p_s, p_t = (s_logits[t - 1] / temperature).softmax(-1), (t_logits[t - 1] / temperature).softmax(-1)
            m = beta * p_t + (1 - beta) * p_s
            jsd_total += (beta * (p_t * (p_t / m).log()).sum() + (1 - beta) * (p_s * (p_s / m).log()).sum()).item()
            nll_total -= s_logits[t - 1].log_softmax(-1)[row["input_ids"][t]].item()
            agree += float(s_logits[t - 1].argmax() == t_logits[t - 1].argmax())
            count += 1
    jsd, nll = jsd_total / count, nll_total / count
    return alpha * jsd + (1 - alpha) * nll, jsd, nll, agree / count


@pytest.mark.parametrize("alpha", [1.0, 0.0, 0.3])
def test_loss_and_metrics_match_float64_reference(tmp_path, tiny_model_path, teacher_path, alpha):
    trainer = DistillationTrainer(
        tiny_model_path,
        teacher_path,
        args=_args(tmp_path, alpha=alpha, beta=0.3, temperature=2.0),
        train_dataset=_data(4, 2),
    )
    rows = [trainer.train_dataset[i] for i in range(4)]
    loss = _eval_loss(trainer, trainer.data_collator(rows))
    with torch.no_grad():
        expected, jsd, nll, agreement = _reference(trainer.model, trainer.teacher_model, rows, alpha, 0.3, 2.0)
    assert loss == pytest.approx(expected, rel=1e-5)
    metrics = trainer._metrics["eval"]
    assert metrics["distill_loss"][-1] == pytest.approx(jsd, rel=1e-5)
    assert metrics["nll"][-1] == pytest.approx(nll, rel=1e-5)
    assert metrics["teacher_agreement"][-1] == pytest.approx(agreement)


def _one_step_params(tmp_path, tiny_model_path, teacher_path, data, **kw):
    trainer = DistillationTrainer(
        tiny_model_path,
        teacher_path,
        args=_args(tmp_path, max_steps=1, optim="sgd", lr_scheduler_type="constant", alpha=0.5, **kw),
        train_dataset=data,
    )
    trainer.train()
    return {n: p.detach().clone() for n, p in trainer.model.named_parameters()}


def test_batch_times_accumulation_equivalence(tmp_path, tiny_model_path, teacher_path):
    data = _data(8, 3)  # completions of 1-4 words: a per-micro-batch mean would differ from the token mean
    full = _one_step_params(tmp_path / "a", tiny_model_path, teacher_path, data, per_device_train_batch_size=8)
    split = _one_step_params(
        tmp_path / "b",
        tiny_model_path,
        teacher_path,
        data,
        per_device_train_batch_size=1,
        gradient_accumulation_steps=8,
    )
    changed = [name for name in full if not torch.equal(full[name], split[name])]
    for name in full:
        torch.testing.assert_close(full[name], split[name], atol=1e-6, rtol=1e-5)
    assert changed  # the step did move the weights (a no-op step would compare equal trivially)


def test_padding_free_gives_the_padded_loss(tmp_path, tiny_model_path, teacher_path):
    losses = []
    for padding_free in (False, True):
        trainer = DistillationTrainer(
            tiny_model_path,
            teacher_path,
            args=_args(tmp_path / str(padding_free), padding_free=padding_free, alpha=0.5),
            train_dataset=_data(6, 4),
        )
        batch = _batch(trainer, 6)
        assert ("attention_mask" in batch) != padding_free
        losses.append(_eval_loss(trainer, batch))
    assert losses[0] == pytest.approx(losses[1], abs=1e-5)


def test_padded_teacher_vocabulary_is_cut_to_the_student_ids(tmp_path, tiny_model_path, tokenizer):
    teacher = _teacher(tokenizer)
    padded = _teacher(tokenizer, vocab_size=len(tokenizer) + 16)
    assert padded.lm_head.weight.shape[0] == len(tokenizer) + 16
    losses = [
        _eval_loss(trainer, _batch(trainer, 4))
        for trainer in (
            DistillationTrainer(
                tiny_model_path, t, args=_args(tmp_path), train_dataset=_data(4, 5), teacher_processing_class=tokenizer
            )
            for t in (teacher, padded)
        )
    ]
    assert losses[0] == pytest.approx(losses[1], rel=1e-6)


def test_teacher_init_kwargs_and_config_name(tmp_path, tiny_model_path, teacher_path):
    trainer = DistillationTrainer(
        tiny_model_path,
        args=_args(
            tmp_path, teacher_model_name_or_path=teacher_path, teacher_model_init_kwargs='{"dtype": "bfloat16"}'
        ),
        train_dataset=_data(2, 0),
    )
    assert trainer.teacher_model.dtype == torch.bfloat16 and trainer.model.dtype == torch.float32
    assert torch.isfinite(torch.tensor(_eval_loss(trainer, _batch(trainer, 2))))


def test_incompatible_teachers_are_refused(tmp_path, tiny_model_path, tokenizer):
    other = build_tiny_tokenizer(vocab_size=300)  # the same merges up to id 300, nothing after
    with pytest.raises(
        ConfigError,
        match=r"student's tokenizer \(.*384 tokens.*\) and the teacher's "
        r"\(LlamaForCausalLM, 300 tokens, vocabulary size 384\)",
    ):
        DistillationTrainer(
            tiny_model_path,
            _teacher(other, vocab_size=len(tokenizer)),
            args=_args(tmp_path),
            train_dataset=_data(2, 0),
            teacher_processing_class=other,
        )
    with pytest.raises(
        ConfigError,
        match=r"teacher's vocabulary size \(300 logits\) is smaller than the student's "
        r"\(384 logits\)",
    ):
        DistillationTrainer(
            tiny_model_path,
            _teacher(other),
            args=_args(tmp_path),
            train_dataset=_data(2, 0),
            teacher_processing_class=other,
        )


def test_teacher_without_tokenizer_checks_sizes_and_warns(tmp_path, tiny_model_path, tokenizer, caplog):
    with caplog.at_level("WARNING", logger="posttrain"):
        DistillationTrainer(tiny_model_path, _teacher(tokenizer), args=_args(tmp_path), train_dataset=_data(2, 0))
    assert "comes without a tokenizer" in caplog.text


def test_errors_before_training(tmp_path, tiny_model_path, teacher_path, tokenizer):
    data = _data(2, 0)
    with pytest.raises(ConfigError, match="needs a teacher"):
        DistillationTrainer(tiny_model_path, args=_args(tmp_path), train_dataset=data)
    with pytest.raises(ConfigError, match="Two teachers"):  # two different ones; the same one twice is TRL's script
        DistillationTrainer(
            tiny_model_path,
            teacher_path,
            train_dataset=data,
            args=_args(tmp_path, teacher_model_name_or_path=tiny_model_path),
        )
    student = build_tiny_model(tokenizer)
    with pytest.raises(ConfigError, match="teacher_model is the student itself"):
        DistillationTrainer(student, student, args=_args(tmp_path), train_dataset=data, processing_class=tokenizer)
    with pytest.raises(ConfigError, match="teacher_model_init_kwargs only applies"):
        DistillationTrainer(
            tiny_model_path,
            _teacher(tokenizer),
            args=_args(tmp_path, teacher_model_init_kwargs={"dtype": "bfloat16"}),
            train_dataset=data,
        )
    for setting, message in [
        ({"beta": 1.2}, "beta=1.2 must lie in"),
        ({"alpha": -0.1}, "alpha=-0.1 must lie in"),
        ({"temperature": 0.0}, "temperature=0.0 must be > 0"),
        ({"chunked_loss": True}, "chunked_loss=True is not available"),
    ]:
        with pytest.raises(ConfigError, match=message):
            _args(tmp_path, **setting)


# -- on-policy distillation (posttrain.experimental) ----------------------------------------------------------
def _on_policy(tmp_path, tiny_model_path, teacher_path, data=None, **kw):
    from posttrain.experimental import OnPolicyDistillationConfig, OnPolicyDistillationTrainer

    return OnPolicyDistillationTrainer(
        tiny_model_path,
        teacher_path,
        args=_args(tmp_path, OnPolicyDistillationConfig, max_new_tokens=5, **kw),
        train_dataset=data or _data(8, 6),
    )


def test_on_policy_batches_hold_the_students_own_tokens(tmp_path, tiny_model_path, teacher_path):
    # A near-zero temperature makes sampling greedy, which model.generate reproduces independently.
    trainer = _on_policy(tmp_path, tiny_model_path, teacher_path, lmbda=1.0, temperature=1e-4)
    data = [_batch(trainer, 4), trainer.data_collator([trainer.train_dataset[i] for i in range(4, 8)])]
    batches, num_items = trainer.get_batch_samples(iter(data), 2, torch.device("cpu"))
    trained = 0
    for original, batch in zip(data, batches):
        for row in range(4):
            assert (original["labels"][row] == -100).all()  # lmbda=1 reads only the prompts, as TRL
            start = int(original["attention_mask"][row].sum())
            prompt = original["input_ids"][row, :start]
            greedy = trainer.model.generate(
                prompt[None], attention_mask=torch.ones_like(prompt[None]), max_new_tokens=5, do_sample=False
            )[0, start:].tolist()
            if trainer.processing_class.eos_token_id in greedy:
                greedy = greedy[: greedy.index(trainer.processing_class.eos_token_id) + 1]
            length = int(batch["attention_mask"][row].sum())
            assert batch["input_ids"][row, :start].tolist() == prompt.tolist()
            assert batch["input_ids"][row, start:length].tolist() == greedy
            assert (batch["labels"][row, :start] == -100).all()
            assert batch["labels"][row, start:length].tolist() == greedy
            assert (batch["labels"][row, length:] == -100).all()
            trained += len(greedy)
    assert int(num_items) == trained
    assert trainer._metrics["train"]["on_policy"] == [1.0, 1.0]


def test_on_policy_training_runs_and_lmbda_zero_keeps_the_data(tmp_path, tiny_model_path, teacher_path):
    trainer = _on_policy(
        tmp_path / "on",
        tiny_model_path,
        teacher_path,
        lmbda=1.0,
        max_steps=2,
        per_device_train_batch_size=4,
        gradient_accumulation_steps=2,
        logging_steps=1,
    )
    trainer.train()
    logs = [h for h in trainer.state.log_history if "loss" in h]
    assert len(logs) == 2 and all(h["on_policy"] == 1.0 and h["distill_loss"] > 0 for h in logs)
    off = _on_policy(tmp_path / "off", tiny_model_path, teacher_path, lmbda=0.0)
    batch = _batch(off, 4)
    (kept,), _ = off.get_batch_samples(iter([batch]), 1, torch.device("cpu"))
    assert kept is batch


def test_on_policy_settings_are_checked(tmp_path, tiny_model_path, teacher_path):
    from posttrain.errors import DataError
    from posttrain.experimental import OnPolicyDistillationConfig

    with pytest.raises(ConfigError, match="lmbda=1.5 must lie in"):
        _args(tmp_path, OnPolicyDistillationConfig, lmbda=1.5)
    with pytest.raises(ConfigError, match="set padding_free=False"):
        _args(tmp_path, OnPolicyDistillationConfig, padding_free=True, lmbda=0.5)
    with pytest.raises(ConfigError, match="language-modeling data .* without prompts"):
        _on_policy(
            tmp_path,
            tiny_model_path,
            teacher_path,
            lmbda=0.5,
            data=Dataset.from_list([{"text": "the cat is on the tree"}] * 2),
        )
    whole = _on_policy(tmp_path, tiny_model_path, teacher_path, lmbda=0.0, completion_only_loss=False)
    with pytest.raises(DataError, match="has no prompt to sample a completion for"):
        whole._student_batch(_batch(whole, 2), 0, "train")


def test_flash_attention_teacher_keeps_padding_free_batches_in_one_row(tmp_path, tiny_model_path):
    from transformers import AutoModelForCausalLM

    teacher = AutoModelForCausalLM.from_pretrained(tiny_model_path)
    teacher.config._attn_implementation = "flash_attention_2"  # only read to choose the batch layout
    data = Dataset.from_list([{"prompt": "the cat", "completion": " is red"}] * 4)
    args = DistillationConfig(
        output_dir=str(tmp_path),
        padding_free=True,
        use_cpu=True,
        bf16=False,
        report_to="none",
        save_strategy="no",
        disable_tqdm=True,
        max_length=32,
        lmbda=0.0,
    )
    trainer = DistillationTrainer(tiny_model_path, teacher_model=teacher, args=args, train_dataset=data)
    assert trainer.data_collator.one_row is True
    student_only = DistillationTrainer(
        tiny_model_path,
        teacher_model=AutoModelForCausalLM.from_pretrained(tiny_model_path),
        args=args,
        train_dataset=data,
    )
    assert student_only.data_collator.one_row is False
