"""Asynchronous GRPO (posttrain.experimental.async_grpo): TRL's import path, defaults and signature; the options
that cannot work here stop at config build; its advantages and first loss against float64 references; a tiny run
one round stale learns a verifiable reward."""

from __future__ import annotations

import dataclasses
import inspect

import pytest
import torch
from _trl import import_trl_experimental as trl_experimental
from test_engine import prompt_dataset, stopping_model

from posttrain.errors import ConfigError
from posttrain.experimental.async_grpo import AsyncGRPOConfig, AsyncGRPOTrainer, population_group_advantages

# posttrain-wide differences (docs/trl_parity.md), and ignore_data_skip: posttrain replays the prompt order on resume
POSTTRAIN_DEFAULTS = {"gradient_checkpointing", "ignore_data_skip"}


def _config(tmp_path, **overrides) -> AsyncGRPOConfig:
    settings = dict(
        output_dir=str(tmp_path),
        use_vllm=False,
        max_staleness=1,
        per_device_train_batch_size=8,
        num_generations=4,
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
    return AsyncGRPOConfig(**settings)


def test_import_path_defaults_and_signature_are_trls():
    theirs = trl_experimental("async_grpo")

    def default(f):
        return f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default

    ours = {f.name: default(f) for f in dataclasses.fields(AsyncGRPOConfig)}
    for f in dataclasses.fields(theirs.AsyncGRPOConfig):
        if f.name not in POSTTRAIN_DEFAULTS:
            assert f.name in ours, f.name
            assert ours[f.name] == default(f), f.name
    params = list(inspect.signature(AsyncGRPOTrainer.__init__).parameters)[1:]
    expected = list(inspect.signature(theirs.AsyncGRPOTrainer.__init__).parameters)[1:]
    assert params[: len(expected)] == expected


@pytest.mark.parametrize(
    "settings, match",
    [
        (dict(request_timeout=30), "request_timeout"),
        (dict(token_budget=4096), "token_budget=4096"),
        (dict(max_inflight_tasks=8), "max_inflight_tasks"),
        (dict(queue_maxsize=16), "queue_maxsize"),
        (dict(heartbeat_stale_after_s=10.0), "heartbeat_stale_after_s"),
        (dict(max_staleness=-1), "max_staleness"),
        (dict(weight_sync_steps=0), "weight_sync_steps"),
        (dict(scale_rewards="batch"), "scale_rewards"),
        (dict(async_generation_rounds=2), "set only max_staleness"),
        (dict(use_vllm=True, vllm_mode="colocate"), "colocated vLLM"),
    ],
)
def test_options_that_cannot_work_here_stop_at_config_build(tmp_path, settings, match):
    with pytest.raises(ConfigError, match=match):
        _config(tmp_path, **settings)


def test_trl_worker_objects_are_refused(tmp_path, tiny_model_path):
    with pytest.raises(ConfigError, match="rollout_worker"):
        AsyncGRPOTrainer(
            tiny_model_path,
            lambda completions, **kw: [0.0] * len(completions),
            args=_config(tmp_path),
            train_dataset=prompt_dataset(),
            rollout_worker=object(),
        )


def test_population_group_advantages_match_a_float64_reference():
    rewards = torch.tensor([1.0, 0.0, 0.5, 0.25, 2.0, float("nan"), 2.0, 0.0, 3.0, 3.0, 3.0, 3.0])
    got = population_group_advantages(rewards, 4)
    expected = []
    for start in range(0, 12, 4):
        group = [float(r) for r in rewards[start : start + 4]]
        scored = [r for r in group if r == r]
        mean = sum(scored) / len(scored)
        std = (sum((r - mean) ** 2 for r in scored) / len(scored)) ** 0.5  # population std, as numpy's default
        expected += [(r - mean) / (std + 1e-8) if r == r else 0.0 for r in group]
    torch.testing.assert_close(got.double(), torch.tensor(expected, dtype=torch.float64), atol=1e-6, rtol=1e-6)
    assert got[8:].abs().max() == 0.0  # equal rewards: no advantage


def test_first_loss_is_the_token_mean_of_the_advantages_and_old_logps_are_the_samplers(tmp_path, tiny_model_path):
    """At step 1 the policy still has the sampling weights, so every ratio is 1 and the clipped surrogate is
    -A per token; with loss_type 'bnpo' the loss is the token mean over the micro-batch."""

    def low_ids(completion_ids, **kwargs):
        return [sum(t < 192 for t in ids) / len(ids) for ids in completion_ids]

    trainer = AsyncGRPOTrainer(
        stopping_model(tiny_model_path),
        low_ids,
        args=_config(tmp_path, max_steps=1, max_staleness=0),
        train_dataset=prompt_dataset(),
    )
    trainer.train()
    rollout = trainer.rollout
    assert rollout.old_logps is rollout.sampler_logps and rollout.policy_version == 0
    rewards = [float(r) for r in rollout.rewards.double()]
    lengths = [int(n) for n in rollout.loss_mask.sum(1)]
    advantages = []
    for start in range(0, len(rewards), 4):
        group = rewards[start : start + 4]
        mean = sum(group) / 4
        std = (sum((r - mean) ** 2 for r in group) / 4) ** 0.5
        advantages += [(r - mean) / (std + 1e-8) for r in group]
    expected = -sum(a * n for a, n in zip(advantages, lengths)) / sum(lengths)
    assert abs(expected) > 1e-3  # completions of different lengths weigh differently
    loss = next(h["loss"] for h in trainer.state.log_history if "loss" in h)
    assert loss == pytest.approx(expected, abs=1e-6)


@pytest.mark.slow
def test_one_round_stale_training_learns_a_verifiable_reward(tmp_path, tiny_model_path):
    """The tiny random model learns to emit four chosen tokens (about 1 in 96 of its tokens at the start), training
    each step on completions sampled with the previous step's weights (it needs about 33 steps to pass 0.9 where
    max_staleness=0 needs 13: the clip is taken against the older sampler)."""
    targets = {298, 299, 300, 301}

    def target_tokens(completion_ids, **kwargs):
        return [sum(t in targets for t in ids) / len(ids) for ids in completion_ids]

    args = _config(
        tmp_path,
        per_device_train_batch_size=16,
        num_generations=8,
        max_completion_length=12,
        learning_rate=3e-2,
        max_steps=40,
        max_staleness=1,
    )
    trainer = AsyncGRPOTrainer(tiny_model_path, target_tokens, args=args, train_dataset=prompt_dataset(64))
    trainer.train()
    history = [h for h in trainer.state.log_history if "reward" in h]
    rewards = [h["reward"] for h in history]
    assert len(rewards) == 40 and all(h["sample/staleness_mean"] == 1.0 for h in history[1:])
    assert sum(rewards[:3]) / 3 < 0.05
    assert sum(rewards[-5:]) / 5 > 0.8
