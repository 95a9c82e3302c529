"""Asynchronous generation in the online engine (posttrain/online/producers/thread.py): k = 0 is the synchronous
run, with k = 1 the round trained at step t was sampled with the weights of step t - 1 (its completions, its
recorded version and its sampler log-probs), resuming with rounds in flight is exact, and the settings the
background thread cannot serve stop before training."""

from __future__ import annotations

import pytest
import torch
from _rollouts import record_rollouts
from test_engine import low_id_fraction, make_config, prompt_dataset, stopping_model
from transformers import AutoModelForCausalLM, TrainerCallback

from posttrain.errors import ConfigError
from posttrain.generation import TransformersBackend, stop_token_ids
from posttrain.online.rollout import PROMPT_IDS_COLUMN, RolloutSampler, round_seeds
from posttrain.trainers.grpo import GRPOTrainer
from posttrain.training.checkpoints import TRAINER_STATE_FILE

# Wall-clock measurements differ between two runs of the same computation.
UNTIMED = ("time/", "perf/", "train_runtime", "train_samples_per_second", "train_steps_per_second", "total_flos")


class WeightsAtStepBegin(TrainerCallback):
    """The policy's parameters before each optimizer step, by the number of steps already taken."""

    def __init__(self):
        self.weights: dict[int, dict[str, torch.Tensor]] = {}

    def on_step_begin(self, args, state, control, model=None, **kwargs):
        self.weights[state.global_step] = {n: v.detach().clone() for n, v in model.state_dict().items()}


class StopAfter(TrainerCallback):
    def __init__(self, step: int):
        self.step = step

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.step:
            control.should_training_stop = True


def grpo(model, output_dir, callbacks=None, **overrides) -> GRPOTrainer:
    # The background thread unless a test asks for the generation process (test_async_process.py).
    settings = {"max_steps": 3, "learning_rate": 0.05, "async_generation_process": False, **overrides}
    args = make_config(output_dir, **settings)
    return GRPOTrainer(model, low_id_fraction, args=args, train_dataset=prompt_dataset(), callbacks=callbacks)


def losses(trainer) -> dict[int, float]:
    return {h["step"]: h["loss"] for h in trainer.state.log_history if "loss" in h}


@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16"])
def test_zero_rounds_ahead_is_the_synchronous_run(tmp_path, tiny_model_path, bf16):
    """With bf16 the background copy runs its forward under the trainer's autocast."""
    sync = grpo(stopping_model(tiny_model_path), tmp_path / "sync", bf16=bf16)
    sync_rollouts = record_rollouts(sync)
    sync.train()
    ahead = grpo(stopping_model(tiny_model_path), tmp_path / "async", async_generation_rounds=0, bf16=bf16)
    ahead_rollouts = record_rollouts(ahead)
    ahead.train()
    assert len(sync_rollouts) == len(ahead_rollouts) == 3
    for one, other in zip(sync_rollouts, ahead_rollouts):
        assert torch.equal(one.completion_ids, other.completion_ids)
        assert one.policy_version == other.policy_version
    lengths = sync_rollouts[0].completion_mask.sum(1)
    assert lengths.min() < lengths.max()  # stop tokens end some completions early: padding is exercised
    # The background copy scores its samples exactly as the trainer does: the importance ratio is exactly 1.
    logged = [h for h in ahead.state.log_history if "loss" in h]
    assert all(h["sampler/logp_diff_max"] == 0.0 and h["sample/staleness_mean"] == 0.0 for h in logged)
    assert losses(ahead) == pytest.approx(losses(sync), abs=1e-6)
    expected = dict(sync.model.named_parameters())
    initial = AutoModelForCausalLM.from_pretrained(tiny_model_path).state_dict()
    assert max((expected[n] - initial[n]).abs().max() for n in expected) > 1e-3
    for name, value in ahead.model.named_parameters():
        torch.testing.assert_close(value, expected[name], atol=1e-6, rtol=0)


def test_one_round_ahead_trains_step_t_on_samples_of_step_t_minus_1(tmp_path, tiny_model_path):
    weights = WeightsAtStepBegin()
    trainer = grpo(
        stopping_model(tiny_model_path), tmp_path / "run", callbacks=[weights], max_steps=4, async_generation_rounds=1
    )
    rollouts = record_rollouts(trainer)
    trainer.train()
    staleness = {h["step"]: h["sample/staleness_mean"] for h in trainer.state.log_history if "loss" in h}
    assert staleness == {1: 0.0, 2: 1.0, 3: 1.0, 4: 1.0}
    sampler = stopping_model(tiny_model_path)  # a second model, loaded with each round's weights
    backend = TransformersBackend(
        sampler, trainer.processing_class.pad_token_id, stop_token_ids(trainer.processing_class, sampler)
    )
    for round_index, rollout in enumerate(rollouts):  # round r trains at step r + 1
        version = max(round_index - 1, 0)
        assert rollout.policy_version == version
        assert {e["policy_version"] for e in rollout.episodes} == {version}
        sampler.load_state_dict(weights.weights[version])
        # Its completions are the samples of the weights of `version`, with the round's seeds ...
        tags = trainer.rollout_sampler.round_tags(round_index)
        rows = [trainer.train_dataset[index] for _, index in tags]
        seeds = round_seeds(trainer.args.seed, round_index, [slot for slot, _ in tags], "train")
        completions = backend.generate([row[PROMPT_IDS_COLUMN] for row in rows], 4, trainer.sampling, seeds)
        for row, completion in enumerate(completions):
            length = len(completion.token_ids)
            assert rollout.completion_ids[row, :length].tolist() == completion.token_ids
        # ... and its sampler log-probs are that model's, not the policy's at the step it trains.
        mask = rollout.completion_mask.bool()
        with torch.no_grad():
            stale, _ = trainer.completion_logps(sampler, rollout.batch(0, len(rollout)))
            sampler.load_state_dict(weights.weights[round_index])
            current, _ = trainer.completion_logps(sampler, rollout.batch(0, len(rollout)))
        torch.testing.assert_close(rollout.sampler_logps[mask], stale[mask], atol=1e-5, rtol=0)
        if round_index >= 2:  # rounds 0 and 1 both come from the initial weights
            assert (current - stale)[mask].abs().max() > 1e-3


@pytest.mark.parametrize(
    "settings",
    [
        dict(async_generation_rounds=1),
        # The sampler refreshes every 2 steps, so the round submitted after the checkpoint reuses older weights.
        dict(async_generation_rounds=2, vllm_sync_steps=2),
        # The checkpoint falls inside a round of 2 steps.
        dict(async_generation_rounds=1, steps_per_generation=2),
    ],
    ids=["k1", "k2_sync2", "k1_steps_per_generation2"],
)
def test_resume_with_rounds_in_flight_is_exact(tmp_path, tiny_model_path, settings):
    common = dict(
        max_steps=6, save_strategy="steps", save_steps=3, per_device_train_batch_size=4, num_generations=2, **settings
    )
    straight = grpo(tiny_model_path, tmp_path / "straight", **common)
    straight.train()
    interrupted = grpo(tiny_model_path, tmp_path / "run", callbacks=[StopAfter(3)], **common)
    interrupted.train()
    assert interrupted.state.global_step == 3
    saved = torch.load(tmp_path / "run" / "checkpoint-3" / TRAINER_STATE_FILE, weights_only=False)
    in_flight, first = saved["async_rollouts"], -(-3 // settings.get("steps_per_generation", 1))
    assert sorted(in_flight["rounds"]) == list(range(first, first + settings["async_generation_rounds"]))
    assert (in_flight["weights"] is not None) == ("vllm_sync_steps" in settings)  # reused weights are saved
    resumed = grpo(tiny_model_path, tmp_path / "run", **common)
    resumed.train(resume_from_checkpoint=True)
    assert resumed.state.global_step == 6
    expected = dict(straight.model.named_parameters())
    for name, value in resumed.model.named_parameters():
        torch.testing.assert_close(value, expected[name], atol=1e-6, rtol=0, msg=name)
    want = {h["step"]: h for h in straight.state.log_history if "loss" in h and h["step"] > 3}
    got = {h["step"]: h for h in resumed.state.log_history if "loss" in h and h["step"] > 3}
    assert sorted(got) == sorted(want) == [4, 5, 6]
    for step, row in want.items():
        keys = {k for k in row if not k.startswith(UNTIMED)}
        assert keys == {k for k in got[step] if not k.startswith(UNTIMED)}
        for key in keys:
            assert got[step][key] == pytest.approx(row[key], rel=1e-5, abs=1e-6), (step, key)


def test_round_tags_are_the_rounds_the_loader_yields():
    sampler = RolloutSampler(12, 4, 2, 1, 3, seed=5)
    for epoch in range(2):
        sampler.set_epoch(epoch)
        batches = list(sampler)[::3]  # one batch per round (each is repeated for the round's micro-steps)
        for batch in batches:
            assert sampler.round_tags(batch[0][0]) == [(slot, index) for _, _, slot, index in batch]


@pytest.mark.parametrize(
    "overrides, message",
    [
        (dict(async_generation_rounds=-1), "async_generation_rounds=-1 must be >= 0"),
        (dict(async_generation_rounds=1, use_vllm=True), "colocated vLLM"),
    ],
)
def test_bad_async_settings_fail_when_the_config_is_built(tmp_path, overrides, message):
    with pytest.raises(ConfigError, match=message):
        make_config(tmp_path, **overrides)


def test_settings_the_thread_cannot_serve_fail_at_construction(tmp_path, tiny_model_path):
    with pytest.raises(ConfigError, match="dynamic_sampling"):
        grpo(tiny_model_path, tmp_path, async_generation_rounds=1, dynamic_sampling=True)

    args = make_config(tmp_path, async_generation_rounds=1)
    with pytest.raises(ConfigError, match="tools, environment_factory or rollout_func"):
        GRPOTrainer(
            tiny_model_path,
            low_id_fraction,
            args=args,
            train_dataset=prompt_dataset(),
            rollout_func=lambda prompts, trainer: {},
        )


def test_evaluation_between_steps_leaves_the_asynchronous_run_unchanged(tmp_path, tiny_model_path):
    """Evaluation generates with the policy while no round generates ahead; training is the same with or without."""
    plain = grpo(tiny_model_path, tmp_path / "plain", async_generation_rounds=1)
    plain.train()
    evaluated = GRPOTrainer(
        tiny_model_path,
        low_id_fraction,
        train_dataset=prompt_dataset(),
        eval_dataset=prompt_dataset(4),
        args=make_config(
            tmp_path / "eval",
            max_steps=3,
            learning_rate=0.05,
            async_generation_rounds=1,
            async_generation_process=False,
            eval_strategy="steps",
            eval_steps=1,
            per_device_eval_batch_size=4,
        ),
    )
    evaluated.train()
    assert len([h for h in evaluated.state.log_history if "eval_reward" in h]) == 3
    assert losses(evaluated) == pytest.approx(losses(plain), abs=1e-6)
    expected = dict(plain.model.named_parameters())
    for name, value in evaluated.model.named_parameters():
        torch.testing.assert_close(value, expected[name], atol=1e-6, rtol=0)


def test_a_loss_that_ignores_the_sampler_is_refused(tmp_path, tiny_model_path):
    from posttrain.experimental.gmpo import GMPOConfig, GMPOTrainer

    args = make_config(tmp_path, config_class=GMPOConfig, async_generation_rounds=1)
    with pytest.raises(ConfigError, match="GMPOTrainer's loss, which does not read the sampler's log-probs"):
        GMPOTrainer(tiny_model_path, low_id_fraction, args=args, train_dataset=prompt_dataset())
