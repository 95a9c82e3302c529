"""PPO resumes exactly: 6 steps straight equal 3 steps, a checkpoint and a new trainer resuming for 3 more
(weights of the policy and the critic, and every logged metric of steps 4-6), for each critic (value model,
value head, a given AutoModelForCausalLMWithValueHead), a LoRA policy, adaptive KL, and a checkpoint that falls
inside a rollout's PPO epochs or mini-batches."""

from __future__ import annotations

import math
import os

import pytest
import torch
from test_engine import low_id_fraction, prompt_dataset
from test_ppo import ppo_config
from transformers import AutoModelForSequenceClassification, AutoTokenizer, TrainerCallback

from posttrain.models.value_head import AutoModelForCausalLMWithValueHead
from posttrain.trainers.ppo import PPOTrainer

STEPS, CHECKPOINT = 6, 3


@pytest.fixture(scope="module")
def value_model_path(tiny_model_path, tmp_path_factory):
    """The tiny Llama with a seeded one-label score head (values of order 1), saved with its tokenizer."""
    torch.manual_seed(1)
    model = AutoModelForSequenceClassification.from_pretrained(tiny_model_path, num_labels=1)
    with torch.no_grad():
        model.score.weight.mul_(10.0)
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_path)
    model.config.pad_token_id = tokenizer.pad_token_id
    path = tmp_path_factory.mktemp("value_model")
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


class StopAt(TrainerCallback):
    """Ends training after `step` (after its checkpoint is written), as a killed job would have."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.step:
            control.should_training_stop = True


def _lora():
    from peft import LoraConfig

    return LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])


# name -> (trainer keywords beyond the config, config overrides); a callable builds a fresh model per trainer
CASES = {
    "value_model": (dict(value_model="value_model_path"), {}),
    "use_value_head": ({}, dict(use_value_head=True)),
    "value_head_model": (dict(model=lambda path: AutoModelForCausalLMWithValueHead.from_pretrained(path)), {}),
    "lora": (dict(peft_config=_lora), dict(use_value_head=True)),
    "adaptive_kl": (dict(value_model="value_model_path"), dict(kl_coef=0.2, target_kl=0.01, kl_horizon=16)),
    "ppo_epochs_4": (dict(value_model="value_model_path"), dict(num_ppo_epochs=4)),  # checkpoint at epoch 3 of 4
    "mini_batches_2_lora": (
        dict(peft_config=_lora),
        dict(num_mini_batches=2, num_ppo_epochs=2, generation_batch_size=8),
    ),  # checkpoint mid-rollout
}


def _trainer(case, output_dir, tiny_model_path, value_model_path, callbacks=None):
    keywords, overrides = CASES[case]
    torch.manual_seed(0)  # a new value head starts from the same draw in every trainer
    built = {"model": tiny_model_path}
    for key, value in keywords.items():
        if value == "value_model_path":
            value = value_model_path
        elif key == "model":
            value = value(tiny_model_path)
        elif callable(value):
            value = value()
        built[key] = value
    settings = dict(
        per_device_train_batch_size=4,
        max_steps=STEPS,
        save_strategy="steps",
        save_steps=CHECKPOINT,
        write_report=False,
        learning_rate=0.05,
        kl_coef=0.1,
    )  # no report: its plots take ~10 s
    args = ppo_config(output_dir, **{**settings, **overrides})
    model = built.pop("model")
    return PPOTrainer(model, low_id_fraction, args=args, train_dataset=prompt_dataset(), callbacks=callbacks, **built)


def _step_logs(trainer, steps):
    """The metrics logged at `steps` (wall-clock timings left out)."""
    return {
        h["step"]: {k: v for k, v in h.items() if not k.startswith("time/")}
        for h in trainer.state.log_history
        if h.get("step") in steps and "loss" in h
    }


@pytest.mark.parametrize("case", list(CASES))
def test_resumed_run_equals_the_straight_run(case, tmp_path, tiny_model_path, value_model_path):
    straight = _trainer(case, tmp_path / "straight", tiny_model_path, value_model_path)
    straight.train()

    run = tmp_path / "run"
    first = _trainer(case, run, tiny_model_path, value_model_path, callbacks=[StopAt(CHECKPOINT)])
    first.train()
    assert first.state.global_step == CHECKPOINT and os.path.isdir(run / f"checkpoint-{CHECKPOINT}")
    before_resume = {n: p.detach().clone() for n, p in first.model.named_parameters()}
    # load_best_model_at_end reads the same checkpoint layout back: the trained policy (or adapter) and critic
    with torch.no_grad():
        for param in first.model.parameters():
            if param.requires_grad:
                param.zero_()
    first.state.best_model_checkpoint = str(run / f"checkpoint-{CHECKPOINT}")
    first._load_best_model()
    for name, param in first.model.named_parameters():
        assert torch.equal(param, before_resume[name]), name
    del first

    resumed = _trainer(case, run, tiny_model_path, value_model_path)
    resumed.train(resume_from_checkpoint=True)
    assert resumed.state.global_step == STEPS

    expected = dict(straight.model.named_parameters())
    params = dict(resumed.model.named_parameters())
    assert params.keys() == expected.keys()
    assert any(not torch.equal(params[n], before_resume[n]) for n in params)  # the resumed run trained
    critic = [n for n in params if n.startswith(("value_model.", "v_head."))]
    assert critic and any(p.requires_grad for n, p in params.items() if n in critic)
    for name, value in params.items():
        torch.testing.assert_close(value, expected[name], atol=1e-6, rtol=0, msg=lambda m, n=name: f"{n}: {m}")

    later = range(CHECKPOINT + 1, STEPS + 1)
    straight_logs, resumed_logs = _step_logs(straight, later), _step_logs(resumed, later)
    assert sorted(resumed_logs) == list(later)
    for step in later:
        assert resumed_logs[step].keys() == straight_logs[step].keys(), step
        for key, value in straight_logs[step].items():
            other = resumed_logs[step][key]
            assert (math.isnan(value) and math.isnan(other)) or other == pytest.approx(value, rel=1e-6, abs=1e-6), (
                f"step {step} {key}: resumed {other}, straight {value}"
            )
    if "target_kl" in CASES[case][1]:  # the coefficient moved, so restoring it mattered
        assert len({straight_logs[s]["kl_coef"] for s in later}) == len(later)
