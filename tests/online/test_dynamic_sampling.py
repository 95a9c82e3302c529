"""GRPOConfig(dynamic_sampling=True), DAPO's dynamic sampling (Yu et al. 2025): groups whose rewards are all equal
are dropped and replaced by groups generated for other prompts, at most max_num_gen_batches generation batches a
round; the fill rate is logged; a resumed run reproduces the uninterrupted one."""

from __future__ import annotations

import pytest
import torch
from test_engine import make_config, prompt_dataset
from test_resume import _common, _logged, _prompts, _StopAfter

from posttrain.errors import ConfigError
from posttrain.trainers.grpo import GRPOConfig, GRPOTrainer


def half_constant(prompts, completion_ids, **kwargs):
    """Prompts with an even number in them get 1.0 for every completion (zero variance); the others the fraction
    of low token ids (varies within a group)."""
    return [
        1.0 if int(p.split()[1]) % 2 == 0 else sum(t < 192 for t in ids) / len(ids)
        for p, ids in zip(prompts, completion_ids)
    ]


class Recorder:
    """Wraps a reward function and a trainer's make_rollout: the reward calls, and the trained groups' rewards."""

    def __init__(self, reward):
        self.reward, self.calls, self.trained = reward, 0, []

    def __call__(self, *args, **kwargs):
        self.calls += 1
        return self.reward(*args, **kwargs)

    def watch(self, trainer):
        make_rollout = trainer.make_rollout

        def recorded(*args, **kwargs):
            rollout = make_rollout(*args, **kwargs)
            self.trained.append(rollout.rewards.view(-1, rollout.num_generations).clone())
            return rollout

        trainer.make_rollout = recorded
        return trainer


def _run(model_path, tmp_path, reward, **overrides):
    recorder = Recorder(reward)
    args = make_config(
        tmp_path, per_device_train_batch_size=8, num_generations=4, max_completion_length=8, max_steps=4, **overrides
    )
    trainer = recorder.watch(GRPOTrainer(model_path, recorder, args=args, train_dataset=prompt_dataset(16)))
    trainer.train()
    return trainer, recorder


def _series(trainer, key):
    return [h[key] for h in trainer.state.log_history if key in h]


def test_every_trained_group_has_reward_variance(tmp_path, tiny_model_path):
    trainer, recorder = _run(tiny_model_path, tmp_path, half_constant, dynamic_sampling=True, max_num_gen_batches=4)
    assert len(recorder.trained) == 4
    for groups in recorder.trained:
        assert groups.shape == (2, 4)  # the round keeps its size
        assert all(bool((g != g[0]).any()) for g in groups)
    assert _series(trainer, "dynamic_sampling/fill_rate") == [1.0] * 4
    assert _series(trainer, "frac_reward_zero_std") == [0.0] * 4
    batches = _series(trainer, "dynamic_sampling/num_gen_batches")
    assert all(1 <= b <= 4 for b in batches) and recorder.calls == sum(batches)
    assert max(batches) > 1  # half the prompts give zero variance, so some rounds needed more generation


def test_without_dynamic_sampling_zero_variance_groups_are_trained(tmp_path, tiny_model_path):
    trainer, recorder = _run(tiny_model_path, tmp_path, half_constant)
    assert recorder.calls == 4 and "dynamic_sampling/fill_rate" not in trainer.state.log_history[0]
    assert sum(_series(trainer, "frac_reward_zero_std")) > 0


def test_the_cap_holds_and_a_short_round_is_completed(tmp_path, tiny_model_path):
    """A reward without variance anywhere: each round generates exactly max_num_gen_batches batches, logs a fill
    rate of 0 and still trains on a full round."""
    trainer, recorder = _run(
        tiny_model_path,
        tmp_path,
        lambda completions, **kw: [0.5] * len(completions),
        dynamic_sampling=True,
        max_num_gen_batches=3,
    )
    assert recorder.calls == 3 * 4
    assert _series(trainer, "dynamic_sampling/num_gen_batches") == [3.0] * 4
    assert _series(trainer, "dynamic_sampling/fill_rate") == [0.0] * 4
    assert all(groups.shape == (2, 4) for groups in recorder.trained)


def test_a_partly_filled_round_reports_its_fill_rate(tmp_path, tiny_model_path):
    """With a cap of one batch nothing is regenerated: the fill rate is the fraction of groups with variance."""
    trainer, recorder = _run(tiny_model_path, tmp_path, half_constant, dynamic_sampling=True, max_num_gen_batches=1)
    assert recorder.calls == 4
    rates = _series(trainer, "dynamic_sampling/fill_rate")
    zero = _series(trainer, "frac_reward_zero_std")
    assert rates == pytest.approx([1 - z for z in zero]) and min(rates) < 1


@pytest.mark.parametrize(
    "overrides, message",
    [
        (dict(max_num_gen_batches=0), r"max_num_gen_batches >= 1 \(it is 0\)"),
    ],
)
def test_bad_dynamic_sampling_settings_fail_when_the_config_is_built(tmp_path, overrides, message):
    with pytest.raises(ConfigError, match=message):
        make_config(tmp_path, dynamic_sampling=True, **overrides)


def _resumable(path, out, callbacks):
    def reward(prompts, completion_ids, **kwargs):
        return [
            1.0 if p.split()[0] in ("cat", "sun", "tree") else sum(t < 192 for t in ids) / len(ids)
            for p, ids in zip(prompts, completion_ids)
        ]

    args = GRPOConfig(
        **_common(
            out,
            per_device_train_batch_size=4,
            num_generations=2,
            max_completion_length=6,
            dynamic_sampling=True,
            max_num_gen_batches=3,
        )
    )
    return GRPOTrainer(path, reward, args=args, train_dataset=_prompts(), callbacks=callbacks)


def test_resume_reproduces_the_uninterrupted_run(tmp_path, tiny_model_path):
    straight = _resumable(tiny_model_path, tmp_path / "straight", None)
    straight.train()
    interrupted = _resumable(tiny_model_path, tmp_path / "run", [_StopAfter(3)])
    interrupted.train()
    resumed = _resumable(tiny_model_path, tmp_path / "run", None)
    resumed.train(resume_from_checkpoint=True)
    expected = dict(straight.model.named_parameters())
    for name, value in resumed.model.named_parameters():
        torch.testing.assert_close(value, expected[name], atol=1e-6, rtol=0, msg=name)
    want, got = _logged(straight, range(4, 7)), _logged(resumed, range(4, 7))
    assert sorted(want) == sorted(got) == [4, 5, 6]
    for step in want:
        assert "dynamic_sampling/fill_rate" in want[step]
        for key, value in want[step].items():
            assert got[step][key] == pytest.approx(value, rel=1e-5, abs=1e-6), (step, key)
