"""Online DPO (posttrain.experimental.online_dpo): the loss against a float64 reference, the same step-0 loss and
metrics as TRL 1.16's OnlineDPOTrainer on fixed completions, learning on a task with a known answer, the judge path
and the config's checks."""

from __future__ import annotations

import math

import pytest
import torch
from _trl import import_trl_experimental
from datasets import Dataset
from test_engine import low_id_fraction, prompt_dataset

from posttrain.errors import ConfigError
from posttrain.experimental.judges import BasePairwiseJudge
from posttrain.experimental.online_dpo import OnlineDPOConfig, OnlineDPOTrainer
from posttrain.losses.online_preference import online_dpo_loss, pair_preferences
from posttrain.online.engine import Episode


def config(tmp_path, cls=OnlineDPOConfig, **overrides):
    settings = dict(
        output_dir=str(tmp_path),
        per_device_train_batch_size=2,
        max_new_tokens=6,
        max_steps=1,
        logging_steps=1,
        learning_rate=1e-2,
        seed=0,
        use_cpu=True,
        bf16=False,
        report_to="none",
        save_strategy="no",
        disable_tqdm=True,
    )
    settings.update(overrides)
    return cls(**settings)


# -- the loss ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("loss_type", ["sigmoid", "ipo"])
def test_online_dpo_loss_matches_the_papers_formula(loss_type):
    torch.manual_seed(0)
    c, r, rc, rr = (torch.randn(7, dtype=torch.float64) * 3 for _ in range(4))
    beta = 0.3
    losses, chosen_rewards, rejected_rewards = online_dpo_loss(
        c.float(), r.float(), rc.float(), rr.float(), beta, loss_type
    )
    for i in range(7):
        h = (c[i].item() - rc[i].item()) - (r[i].item() - rr[i].item())
        expected = math.log1p(math.exp(-beta * h)) if loss_type == "sigmoid" else (h - 1 / (2 * beta)) ** 2
        assert losses[i].item() == pytest.approx(expected, rel=1e-5, abs=1e-5)
        assert chosen_rewards[i].item() == pytest.approx(beta * (c[i].item() - rc[i].item()), abs=1e-5)
        assert rejected_rewards[i].item() == pytest.approx(beta * (r[i].item() - rr[i].item()), abs=1e-5)


def test_pair_preferences_prefer_the_higher_score_and_the_first_on_ties():
    scores = torch.tensor([[1.0, 0.0], [0.0, 2.0], [0.5, 0.5]])
    assert pair_preferences(scores).tolist() == [True, False, True]


# -- config ----------------------------------------------------------------------------------------------------
def test_trl_defaults_and_beta_list(tmp_path):
    args = OnlineDPOConfig(output_dir=str(tmp_path), use_cpu=True)
    assert (
        args.beta,
        args.temperature,
        args.max_new_tokens,
        args.max_length,
        args.learning_rate,
        args.loss_type,
        args.missing_eos_penalty,
        args.num_generations,
    ) == (0.1, 0.9, 64, 512, 5e-7, "sigmoid", None, 2)
    assert args.max_completion_length == 64
    assert OnlineDPOConfig(output_dir=str(tmp_path), use_cpu=True, beta=[0.2, 0.05]).beta == [0.2, 0.05]


def test_config_fields_and_trainer_arguments_follow_trl():
    import dataclasses
    import inspect

    online_dpo = import_trl_experimental("online_dpo")
    TRLConfig, TRLTrainer = online_dpo.OnlineDPOConfig, online_dpo.OnlineDPOTrainer

    def default(f):
        return f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default

    ours = {f.name: default(f) for f in dataclasses.fields(OnlineDPOConfig)}
    for f in dataclasses.fields(TRLConfig):
        assert f.name in ours, f.name
        if f.name != "gradient_checkpointing":  # None (auto) in posttrain, on purpose
            assert ours[f.name] == default(f), f.name
    theirs = list(inspect.signature(TRLTrainer.__init__).parameters)
    assert list(inspect.signature(OnlineDPOTrainer.__init__).parameters)[: len(theirs)] == theirs


@pytest.mark.parametrize(
    "overrides, message",
    [
        (dict(beta=[0.1, -1.0]), "beta="),
        (dict(loss_type="hinge"), "loss_type"),
        (dict(num_generations=4), "num_generations=4"),
        (dict(missing_eos_penalty=-1.0), "missing_eos_penalty"),
    ],
)
def test_bad_settings_fail_when_the_config_is_built(tmp_path, overrides, message):
    with pytest.raises(ConfigError, match=message):
        config(tmp_path, **overrides)


def test_trainer_rejects_a_data_collator_and_missing_rewards(tmp_path, tiny_model_path):
    with pytest.raises(ConfigError, match="data_collator"):
        OnlineDPOTrainer(
            tiny_model_path,
            reward_funcs=low_id_fraction,
            args=config(tmp_path),
            data_collator=lambda x: x,
            train_dataset=prompt_dataset(4),
        )
    with pytest.raises(ConfigError, match="needs reward_funcs"):
        OnlineDPOTrainer(tiny_model_path, args=config(tmp_path), train_dataset=prompt_dataset(4))


def test_reward_funcs_win_over_reward_model_path_as_in_trl(tmp_path, tiny_model_path, caplog):
    """TRL's scripts load the reward model from --reward_model_path and pass it as reward_funcs; TRL's trainer never
    reads the path. Both given: the trainer scores with reward_funcs (the path, which does not exist here, is not
    loaded) and says so in the log."""
    import logging

    with caplog.at_level(logging.INFO, logger="posttrain"):
        trainer = OnlineDPOTrainer(
            tiny_model_path,
            reward_funcs=low_id_fraction,
            args=config(tmp_path, reward_model_path=str(tmp_path / "no_such_reward_model")),
            train_dataset=prompt_dataset(4),
        )
    assert [getattr(f, "__name__", None) for f in trainer.reward_funcs] == ["low_id_fraction"]
    assert "reward_model_path" in caplog.text and "not loaded again" in caplog.text


# -- side by side with TRL 1.16 ------------------------------------------------------------------------------
COMPLETIONS = {  # per prompt: two fixed completions (token ids; EOS is appended to the first)
    0: ([11, 12, 13, 14, 15], [40, 41, 42]),
    1: ([200, 201, 202, 203], [7, 8, 9, 10, 11, 12]),
}


def test_step0_loss_and_metrics_match_trl(tmp_path, tiny_model_path, tokenizer):
    online_dpo = import_trl_experimental("online_dpo")
    TRLConfig, TRLTrainer = online_dpo.OnlineDPOConfig, online_dpo.OnlineDPOTrainer
    from transformers import AutoModelForCausalLM

    prompts = ["cat 1 and dog", "dog 2 and dog"]
    prompt_ids = [tokenizer(p)["input_ids"] for p in prompts]
    assert len(prompt_ids[0]) == len(prompt_ids[1])  # no padding: both sides number positions alike
    eos = tokenizer.eos_token_id
    completions = {p: (COMPLETIONS[i][0] + [eos], COMPLETIONS[i][1]) for i, p in enumerate(prompts)}
    data = Dataset.from_list([{"prompt": p} for p in prompts])

    def reward(completion_ids, **kwargs):  # known scores: low token ids are better (TRL's ids carry padding)
        ids = [[t for t in row if t != tokenizer.pad_token_id] for row in completion_ids]
        return [-sum(row) / len(row) for row in ids]

    common = dict(
        per_device_train_batch_size=2,
        max_new_tokens=8,
        max_steps=1,
        logging_steps=1,
        learning_rate=0.0,
        seed=0,
        use_cpu=True,
        report_to="none",
        save_strategy="no",
        disable_tqdm=True,
        beta=0.2,
        missing_eos_penalty=1.5,
        bf16=False,
        gradient_checkpointing=False,
    )

    def reference():  # a reference that differs from the policy, so that the loss is not log 2
        model = AutoModelForCausalLM.from_pretrained(tiny_model_path)
        with torch.no_grad():
            for i, parameter in enumerate(model.parameters()):
                parameter.add_(torch.randn(parameter.shape, generator=torch.Generator().manual_seed(i)) * 0.05)
        return model

    def recording(trainer):  # the step's loss, unrounded
        losses, step = [], trainer.training_step
        trainer.training_step = lambda *a, **k: losses.append(float(step(*a, **k))) or torch.tensor(losses[-1])
        return losses

    ours = OnlineDPOTrainer(
        AutoModelForCausalLM.from_pretrained(tiny_model_path),
        reference(),
        reward_funcs=reward,
        args=OnlineDPOConfig(output_dir=str(tmp_path / "ours"), **common),
        train_dataset=data,
        processing_class=tokenizer,
    )

    def our_generation(rows, n, seeds):
        return [
            Episode(list(ids), [1] * len(ids), None, ids[-1] == eos)
            for row in rows
            for ids in completions[row["prompt"]]
        ]

    ours.generate_episodes = our_generation
    our_losses = recording(ours)
    ours.train()

    theirs = TRLTrainer(
        AutoModelForCausalLM.from_pretrained(tiny_model_path),
        reference(),
        reward_funcs=reward,
        args=TRLConfig(output_dir=str(tmp_path / "trl"), **common),
        train_dataset=data,
        processing_class=tokenizer,
    )
    pad = tokenizer.pad_token_id

    def trl_generation(model, batch_prompts, images=None):
        firsts = [completions[p][0] for p in batch_prompts]
        seconds = [completions[p][1] for p in batch_prompts]
        rows = firsts + seconds
        width = max(map(len, rows))
        ids = torch.tensor([r + [pad] * (width - len(r)) for r in rows])
        mask = torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in rows])
        p_ids = torch.tensor([prompt_ids[prompts.index(p)] for p in batch_prompts]).repeat(2, 1)
        return p_ids, torch.ones_like(p_ids), ids, mask, None

    theirs._generate = trl_generation
    trl_losses = recording(theirs)
    theirs.train()
    assert our_losses[0] == pytest.approx(trl_losses[0], abs=1e-5) and abs(our_losses[0] - math.log(2)) > 1e-3
    mine, trls = ours.state.log_history[0], theirs.state.log_history[0]
    # objective/kl, /entropy, /non_score_reward, /rlhf_reward differ on purpose: TRL sums them over padding too.
    keys = [
        "objective/scores",
        "objective/scores_margin",
        "rewards/chosen",
        "rewards/rejected",
        "rewards/margins",
        "rewards/accuracies",
        "logps/chosen",
        "logps/rejected",
        "val/contain_eos_token",
        "beta",
    ]
    for key in keys:
        assert mine[key] == pytest.approx(trls[key], abs=1e-5, rel=1e-5), key
    assert mine["objective/scores_margin"] > 0 and mine["val/contain_eos_token"] == 0.5


# -- learning and the judge ------------------------------------------------------------------------------------
def learning_run(trainer_class, config_class, tmp_path, model_path, reward=low_id_fraction, **overrides):
    """`reward` per step on a task with a known answer: the fraction of tokens below id 192 (about half at the
    start; 1 is reachable)."""
    settings = dict(
        per_device_train_batch_size=8,
        max_new_tokens=8,
        max_steps=14,
        learning_rate=1e-1,
        beta=0.1,
        temperature=1.0,
        lr_scheduler_type="constant",
    )
    settings.update(overrides)
    trainer = trainer_class(
        model_path,
        reward_funcs=reward,
        train_dataset=prompt_dataset(64),
        args=config(tmp_path, config_class, **settings),
    )
    trainer.train()
    return trainer, [h["reward"] for h in trainer.state.log_history if "reward" in h]


def test_online_dpo_learns_a_known_preference(tmp_path, tiny_model_path):
    trainer, rewards = learning_run(OnlineDPOTrainer, OnlineDPOConfig, tmp_path, tiny_model_path)
    print("online dpo reward", rewards[:3], "->", rewards[-3:])
    assert sum(rewards[:3]) / 3 < 0.6
    assert sum(rewards[-3:]) / 3 > 0.85


class LowIdJudge(BasePairwiseJudge):
    """Prefers the completion with more tokens below id 192 (decoded text: fewer letters from the high ids)."""

    def __init__(self):
        self.calls = 0

    def judge(self, prompts, completions, shuffle_order=True):
        self.calls += 1
        assert len(prompts) == len(completions) and all(len(pair) == 2 for pair in completions)
        return [0 if len(a) <= len(b) else 1 for a, b in completions]


def test_judge_picks_the_chosen_completion(tmp_path, tiny_model_path):
    judge = LowIdJudge()
    trainer = OnlineDPOTrainer(
        tiny_model_path, judge=judge, train_dataset=prompt_dataset(4), args=config(tmp_path, temperature=1.0)
    )
    trainer.train()
    rollout = trainer.rollout
    texts = trainer.processing_class.batch_decode(
        rollout.completion_ids * rollout.completion_mask, skip_special_tokens=True
    )
    for pair in range(len(rollout) // 2):
        a, b = texts[2 * pair].strip(), texts[2 * pair + 1].strip()
        expected_first = len(a) <= len(b)
        assert rollout.advantages[2 * pair].item() == (1.0 if expected_first else -1.0)
        assert rollout.advantages[2 * pair + 1].item() == -rollout.advantages[2 * pair].item()
    assert judge.calls >= 1
    with pytest.raises(ConfigError, match="either a judge or reward_funcs"):
        OnlineDPOTrainer(
            tiny_model_path,
            reward_funcs=low_id_fraction,
            judge=judge,
            train_dataset=prompt_dataset(4),
            args=config(tmp_path),
        )
