"""posttrain.experimental.gkd against TRL 1.16's trl.experimental.gkd: the same step-0 loss on the same tiny student,
teacher and messages batch, TRL's config defaults and signature, seq_kd's teacher samples, and that it learns."""

import dataclasses
import inspect
import random

import pytest
import torch
from _trl import import_trl_experimental
from datasets import Dataset

from posttrain.errors import DataError
from posttrain.experimental.gkd import GKDConfig, GKDTrainer
from posttrain.models.tiny import build_tiny_model

WORDS = "red green blue cat dog bird fish sky sun moon tree".split()


def _trl_gkd():
    return import_trl_experimental("gkd")


def _messages(n, tokenizer, seed=0):
    """Two-word prompts and completions, all rendering to the same number of tokens, so that TRL's left-padded and
    posttrain's right-padded batches hold the same positions (transformers numbers positions from the left edge)."""
    rng, rows, length = random.Random(seed), [], None
    while len(rows) < n:
        messages = [
            {"role": "user", "content": " ".join(rng.sample(WORDS, 2))},
            {"role": "assistant", "content": " ".join(rng.sample(WORDS, 2))},
        ]
        size = len(tokenizer.apply_chat_template(messages, tokenize=True, return_dict=False))
        length = length or size
        if size == length:
            rows.append({"messages": messages})
    return Dataset.from_list(rows)


def _teacher(tokenizer):
    teacher = build_tiny_model(tokenizer, seed=1, hidden_size=64, tie=False)
    with torch.no_grad():
        teacher.lm_head.weight.mul_(5.0)
    return teacher


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


@pytest.mark.parametrize("beta,temperature", [(0.5, 0.9), (0.0, 1.0), (1.0, 0.5), (0.2, 2.0)])
def test_step0_loss_equals_trls_offline(tmp_path, tokenizer, beta, temperature):
    gkd = _trl_gkd()
    data = _messages(4, tokenizer)
    theirs = gkd.GKDTrainer(
        model=build_tiny_model(tokenizer),
        teacher_model=_teacher(tokenizer),
        train_dataset=data,
        processing_class=tokenizer,
        args=gkd.GKDConfig(
            **_kw(
                tmp_path / "trl",
                bf16=False,
                gradient_checkpointing=False,
                lmbda=0.0,
                beta=beta,
                temperature=temperature,
            )
        ),
    )
    batch = theirs.data_collator([data[i] for i in range(4)])
    assert bool((batch["attention_mask"] == 1).all())  # no padding: see _messages
    theirs.model.eval()
    with torch.no_grad():
        trl_loss = theirs.compute_loss(
            theirs.model, {k: batch[k] for k in ("input_ids", "attention_mask", "labels")}
        ).item()
    ours = GKDTrainer(
        build_tiny_model(tokenizer),
        _teacher(tokenizer),
        args=GKDConfig(**_kw(tmp_path / "ours", lmbda=0.0, beta=beta, temperature=temperature)),
        train_dataset=data,
        processing_class=tokenizer,
    )
    rows = [ours.train_dataset[i] for i in range(4)]
    ours_batch = ours.data_collator(rows)
    assert ours_batch["input_ids"].tolist() == batch["input_ids"].tolist()
    assert ours_batch["labels"].tolist() == batch["labels"].tolist()  # the same trained tokens
    ours.model.eval()
    with torch.no_grad():
        our_loss = ours.compute_loss(ours.model, ours_batch).item()
    assert our_loss > 1e-3
    assert our_loss == pytest.approx(trl_loss, abs=1e-5, rel=1e-5)


def test_config_defaults_and_signature_are_trls():
    gkd = _trl_gkd()

    def default(f):
        return f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default

    ours = {f.name: default(f) for f in dataclasses.fields(GKDConfig)}
    # posttrain-wide deliberate differences (docs/trl_parity.md): auto gradient checkpointing, kept columns.
    skip = {"gradient_checkpointing", "remove_unused_columns"}
    for f in dataclasses.fields(gkd.GKDConfig):
        if f.name not in skip:
            assert f.name in ours, f.name
            assert ours[f.name] == default(f), f.name
    params = list(inspect.signature(GKDTrainer.__init__).parameters)[1:]
    theirs = list(inspect.signature(gkd.GKDTrainer.__init__).parameters)[1:]
    assert params[: len(theirs)] == theirs
    assert GKDConfig(output_dir="unused", use_cpu=True, max_new_tokens=7).max_completion_length == 7


def test_loss_ignores_the_sampling_temperature(tmp_path, tokenizer):
    losses = []
    for temperature in (0.5, 2.0):
        trainer = GKDTrainer(
            build_tiny_model(tokenizer),
            _teacher(tokenizer),
            processing_class=tokenizer,
            train_dataset=_messages(4, tokenizer),
            args=GKDConfig(**_kw(tmp_path, lmbda=0.0, temperature=temperature)),
        )
        trainer.model.eval()
        with torch.no_grad():
            losses.append(
                trainer.compute_loss(
                    trainer.model, trainer.data_collator([trainer.train_dataset[i] for i in range(4)])
                ).item()
            )
    assert losses[0] == pytest.approx(losses[1], rel=1e-6)


def test_seq_kd_trains_on_the_teachers_samples(tmp_path, tokenizer):
    """A teacher that always says 'moon': with seq_kd every off-policy micro-batch's completion is the teacher's."""
    teacher = _teacher(tokenizer)
    moon = tokenizer(" moon", add_special_tokens=False)["input_ids"][-1]
    with torch.no_grad():
        teacher.lm_head.weight.zero_()
        teacher.lm_head.weight[moon] = 1.0
        teacher.model.norm.weight.fill_(100.0)  # large hidden state: the 'moon' logit dominates wherever it is positive
    args = GKDConfig(**_kw(tmp_path, lmbda=0.0, seq_kd=True, max_new_tokens=5, temperature=1e-3))
    trainer = GKDTrainer(
        build_tiny_model(tokenizer),
        teacher,
        args=args,
        train_dataset=_messages(4, tokenizer),
        processing_class=tokenizer,
    )
    batch = trainer.data_collator([trainer.train_dataset[i] for i in range(4)])
    sampled = trainer._off_policy_batch(batch, seed=0)
    completions = sampled["input_ids"][sampled["labels"] != -100]
    assert len(completions) > 0
    assert (completions == moon).float().mean() > 0.5
    plain = GKDTrainer(
        build_tiny_model(tokenizer),
        _teacher(tokenizer),
        train_dataset=_messages(4, tokenizer),
        processing_class=tokenizer,
        args=GKDConfig(**_kw(tmp_path, lmbda=0.0)),
    )
    assert plain._off_policy_batch(batch, seed=0) is batch


def test_rejects_single_message_rows(tmp_path, tokenizer):
    data = Dataset.from_list([{"messages": [{"role": "user", "content": "red cat"}]}])
    with pytest.raises(DataError, match="at least two"):
        GKDTrainer(
            build_tiny_model(tokenizer),
            _teacher(tokenizer),
            args=GKDConfig(**_kw(tmp_path)),
            train_dataset=data,
            processing_class=tokenizer,
        )


def test_learns_the_teacher_offline(tmp_path, tokenizer):
    trainer = GKDTrainer(
        build_tiny_model(tokenizer),
        _teacher(tokenizer),
        processing_class=tokenizer,
        train_dataset=_messages(16, tokenizer),
        args=GKDConfig(**_kw(tmp_path, lmbda=0.0, max_steps=20, learning_rate=3e-3, logging_steps=1)),
    )
    trainer.train()
    losses = [h["distill_loss"] for h in trainer.state.log_history if "distill_loss" in h]
    assert len(losses) == 20
    assert sum(losses[-3:]) / 3 < 0.7 * sum(losses[:3]) / 3, losses
