"""Asynchronous on-policy distillation (posttrain.experimental.async_distillation): TRL's import path, defaults and
signature; the options that cannot work here stop at config build; the first loss against a float64 forward KL on
the teacher's top-k plus a tail bucket; a student one round stale learns the teacher's preferred tokens."""

from __future__ import annotations

import dataclasses
import inspect

import pytest
import torch
from test_async_grpo import POSTTRAIN_DEFAULTS, trl_experimental
from test_engine import prompt_dataset
from torch import nn
from transformers import AutoModelForCausalLM, AutoTokenizer

from posttrain.errors import ConfigError
from posttrain.experimental.async_distillation import AsyncDistillationConfig, AsyncDistillationTrainer
from posttrain.models.tiny import build_tiny_model

TARGETS = [298, 299, 300, 301]


def _config(tmp_path, **overrides) -> AsyncDistillationConfig:
    settings = dict(
        output_dir=str(tmp_path),
        use_vllm=False,
        max_staleness=1,
        per_device_train_batch_size=8,
        max_completion_length=8,
        max_steps=2,
        learning_rate=0.05,
        seed=0,
        use_cpu=True,
        bf16=False,
        report_to="none",
        save_strategy="no",
        disable_tqdm=True,
        write_report=False,
    )
    settings.update(overrides)
    return AsyncDistillationConfig(**settings)


def biased_teacher(model_path: str, bias: float = 6.0):
    """A tiny model of another seed whose output layer strongly prefers TARGETS."""
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    teacher = build_tiny_model(tokenizer, seed=1, tie=False)
    head = teacher.lm_head
    biased = nn.Linear(head.in_features, head.out_features, bias=True)
    with torch.no_grad():
        biased.weight.copy_(head.weight)
        biased.bias.zero_()
        biased.bias[TARGETS] = bias
    teacher.lm_head = biased
    return teacher


def test_import_path_defaults_and_signature_are_trls():
    theirs = trl_experimental("async_distillation")

    def default(f):
        return f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default

    ours = {f.name: default(f) for f in dataclasses.fields(AsyncDistillationConfig)}
    for f in dataclasses.fields(theirs.AsyncDistillationConfig):
        if f.name not in POSTTRAIN_DEFAULTS:
            assert f.name in ours, f.name
            assert ours[f.name] == default(f), f.name
    params = list(inspect.signature(AsyncDistillationTrainer.__init__).parameters)[1:]
    expected = list(inspect.signature(theirs.AsyncDistillationTrainer.__init__).parameters)[1:]
    assert params[: len(expected)] == expected


@pytest.mark.parametrize(
    "settings, match",
    [
        (dict(teacher_server_urls={"math": "http://a:1", "code": "http://b:2"}), "MOPD"),
        (dict(beta=1.5), r"beta=1.5 must be in \[0, 1\]"),
        (dict(teacher_top_k=0), "teacher_top_k"),
        (dict(loss_type="grpo"), "loss_type"),
        (dict(request_timeout=30), "request_timeout"),
        (dict(log_completions_steps=10), "log_completions_steps"),
        (dict(max_staleness=-2), "max_staleness"),
    ],
)
def test_options_that_cannot_work_here_stop_at_config_build(tmp_path, settings, match):
    with pytest.raises(ConfigError, match=match):
        _config(tmp_path, **settings)


def test_first_loss_is_the_forward_kl_on_the_teachers_top_k_with_a_tail(tmp_path, tiny_model_path):
    teacher = biased_teacher(tiny_model_path, bias=2.0)
    args = _config(tmp_path, max_steps=1, learning_rate=0.0, teacher_top_k=3, teacher_temperature=1.5, max_staleness=0)
    trainer = AsyncDistillationTrainer(
        tiny_model_path, args=args, train_dataset=prompt_dataset(), teacher_model=teacher
    )
    trainer.train()
    rollout, loss = trainer.rollout, trainer.state.log_history[0]["loss"]
    student = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float64)
    teacher = teacher.double()
    total, count = 0.0, 0
    for i in range(len(rollout)):
        prompt = rollout.prompt_ids[i][rollout.prompt_mask[i].bool()].tolist()
        completion = rollout.completion_ids[i][rollout.completion_mask[i].bool()].tolist()
        ids = torch.tensor([prompt + completion])
        with torch.no_grad():
            p_all = (teacher(ids).logits[0] / 1.5).log_softmax(-1)
            q_all = (student(ids).logits[0] / 1.5).log_softmax(-1)
        for t in range(len(completion)):
            position = len(prompt) - 1 + t  # the logits that predict completion token t
            top = p_all[position].topk(3).indices
            p, q = p_all[position][top].exp(), q_all[position][top].exp()
            p_tail, q_tail = 1 - p.sum(), 1 - q.sum()
            total += float((p * (p.log() - q.log())).sum() + p_tail * (p_tail.log() - q_tail.log()))
            count += 1
    assert total / count > 1e-3
    assert loss == pytest.approx(total / count, rel=1e-4, abs=1e-6)
    reward = next(h["reward"] for h in trainer.state.log_history if "reward" in h)
    assert reward < -1.0  # the teacher's mean log-prob of the student's tokens, logged as the reward


def test_teacher_and_teacher_server_urls_are_exclusive(tmp_path, tiny_model_path):
    with pytest.raises(ConfigError, match="Both teacher_model and teacher_server_urls"):
        AsyncDistillationTrainer(
            tiny_model_path,
            args=_config(tmp_path, teacher_server_urls={"t": "http://x:1"}),
            train_dataset=prompt_dataset(),
            teacher_model=biased_teacher(tiny_model_path),
        )


@pytest.mark.slow
def test_a_student_one_round_stale_learns_the_teachers_tokens(tmp_path, tiny_model_path):
    args = _config(tmp_path, per_device_train_batch_size=16, max_steps=15, learning_rate=3e-2, max_staleness=1)
    trainer = AsyncDistillationTrainer(
        tiny_model_path, args=args, train_dataset=prompt_dataset(64), teacher_model=biased_teacher(tiny_model_path)
    )
    trainer.train()
    history = [h for h in trainer.state.log_history if "reward" in h]
    rewards = [h["reward"] for h in history]  # the teacher's mean log-prob of the student's tokens
    assert all(h["sample/staleness_mean"] == 1.0 for h in history[1:])
    assert sum(rewards[-3:]) / 3 > sum(rewards[:3]) / 3 + 2.0
