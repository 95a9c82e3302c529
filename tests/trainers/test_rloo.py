"""RLOOConfig / RLOOTrainer options beyond the advantages themselves (those are in test_grpo_trainer.py):
reward_clip_range, the reference-KL metric, evaluation with num_generations_eval, TRL's defaults."""

from __future__ import annotations

import pytest
import torch
from test_engine import logged, make_config, prompt_dataset, stopping_model, train

from posttrain.errors import ConfigError
from posttrain.trainers.rloo import RLOOConfig, RLOOTrainer


def length_reward(completion_ids, **kwargs):
    return [float(len(ids)) for ids in completion_ids]


def _leave_one_out(rewards: list[float], k: int) -> list[float]:
    out = []
    for start in range(0, len(rewards), k):
        group = rewards[start : start + k]
        out += [r - (sum(group) - r) / (k - 1) for r in group]
    return out


@pytest.mark.parametrize(
    "value, message",
    [
        ([3.0, 1.0], r"reward_clip_range=\[3.0, 1.0\] must be two numbers \[min, max\] with min <= max"),
        ([1.0], r"must be two numbers"),
    ],
)
def test_bad_reward_clip_range_fails_when_the_config_is_built(tmp_path, value, message):
    with pytest.raises(ConfigError, match=message):
        make_config(tmp_path, RLOOConfig, reward_clip_range=value)


def test_reward_clip_range_clips_the_rewards_before_the_baseline(tmp_path, tiny_model_path):
    trainer = train(
        stopping_model(tiny_model_path),
        tmp_path,
        reward=length_reward,
        trainer_class=RLOOTrainer,
        config_class=RLOOConfig,
        num_generations=4,
        beta=0.0,
        reward_clip_range=[2.0, 5.0],
    )
    rollout = trainer.rollout
    lengths = rollout.completion_mask.sum(1).double().tolist()
    assert min(lengths) < 2 or max(lengths) > 5  # some rewards are clipped
    expected = _leave_one_out([min(max(x, 2.0), 5.0) for x in lengths], 4)
    torch.testing.assert_close(
        rollout.advantages.double(), torch.tensor(expected, dtype=torch.float64), atol=1e-6, rtol=0
    )
    assert logged(trainer, "reward", 1) == pytest.approx(sum(lengths) / len(lengths), abs=1e-6)  # raw rewards
    assert trainer.args.reward_clip_range == (2.0, 5.0)


def test_rloo_logs_the_kl_to_the_reference(tmp_path, tiny_model_path):
    trainer = train(
        stopping_model(tiny_model_path),
        tmp_path,
        reward=length_reward,
        trainer_class=RLOOTrainer,
        config_class=RLOOConfig,
        num_generations=4,
        beta=0.5,
        max_steps=2,
        learning_rate=0.05,
    )
    rollout = trainer.rollout  # of step 2: the policy has moved from the reference
    mask = rollout.loss_mask.double()
    expected = ((rollout.old_logps - rollout.ref_logps).double() * mask).sum() / mask.sum()
    assert abs(float(expected)) > 1e-5
    assert logged(trainer, "kl", 2) == pytest.approx(float(expected), abs=1e-6)
    assert logged(trainer, "kl", 1) == pytest.approx(0.0, abs=1e-6)  # the policy starts as the reference


def test_rloo_evaluates_with_num_generations_eval(tmp_path, tiny_model_path):
    seen = []

    def recorded(prompts, completion_ids, **kwargs):
        seen.append(len(completion_ids))
        return length_reward(completion_ids)

    trainer = RLOOTrainer(
        stopping_model(tiny_model_path),
        recorded,
        train_dataset=prompt_dataset(),
        eval_dataset=prompt_dataset(4),
        args=make_config(tmp_path, RLOOConfig, num_generations=4, num_generations_eval=3, per_device_eval_batch_size=6),
    )
    metrics = trainer.evaluate()
    assert seen == [6, 6]  # 4 prompts, 2 per round, 3 completions each
    assert metrics["eval_reward"] > 0 and "eval_kl" in metrics and "eval_loss" in metrics


def test_named_eval_sets_are_evaluated_each_under_its_prefix(tmp_path, tiny_model_path):
    calls = []

    def recorded(completion_ids, **kwargs):
        calls.append(length_reward(completion_ids))
        return calls[-1]

    trainer = RLOOTrainer(
        stopping_model(tiny_model_path),
        recorded,
        train_dataset=prompt_dataset(),
        eval_dataset={"short": prompt_dataset(2), "long": prompt_dataset(4)},
        args=make_config(tmp_path, RLOOConfig, num_generations=4, per_device_eval_batch_size=4),
    )
    metrics = trainer.evaluate()
    assert {"eval_short_reward", "eval_long_reward", "eval_short_loss", "eval_long_loss"} <= set(metrics)
    short, long = calls[:2], calls[2:]  # one prompt (4 completions) per eval round
    assert len(long) == 4 and long[:2] == short  # same prompts at the same positions: the same completions
    mean = lambda rounds: sum(sum(r) for r in rounds) / sum(len(r) for r in rounds)  # noqa: E731
    assert metrics["eval_short_reward"] == pytest.approx(mean(short), abs=1e-6)
    assert metrics["eval_long_reward"] == pytest.approx(mean(long), abs=1e-6)
