"""The online RL engine (posttrain/online/engine.py), exercised through GRPOTrainer: batch arithmetic,
errors before training, prompt preparation, what reward functions receive, metrics, reproducibility, and
the invariance of the first update's gradient to how the batch is split (micro-batches, steps per
generation, processes).

Also the worker for the two-process test: `python -m torch.distributed.run --nproc_per_node 2
tests/online/test_engine.py MODEL_PATH OUT_DIR PER_DEVICE_BATCH_SIZE`.
"""

from __future__ import annotations

import copy
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from _paths import subprocess_pythonpath
from datasets import Dataset
from transformers import AutoModelForCausalLM, TrainerCallback

from posttrain.errors import ConfigError, DataError
from posttrain.online.engine import Rollout, RolloutSampler, groupwise_advantages
from posttrain.trainers.grpo import GRPOConfig, GRPOTrainer
from posttrain.trainers.rloo import RLOOConfig

REPO_ROOT = Path(__file__).resolve().parents[2]
TARGET_TOKEN = 298  # " the" in the tiny tokenizer; the rewards below count it


# -- helpers shared with test_grpo_trainer.py ----------------------------------------------------------------
def make_config(output_dir, config_class=GRPOConfig, **overrides):
    settings = dict(
        output_dir=str(output_dir),
        per_device_train_batch_size=8,
        num_generations=4,
        max_completion_length=8,
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
    return config_class(**settings)


def prompt_dataset(n: int = 16) -> Dataset:
    words = ["cat", "dog", "sun", "moon", "tree", "fish", "bird", "sky"]
    return Dataset.from_list(
        [{"prompt": f"{words[i % 8]} {i} and {words[(3 * i) % 8]}", "answer": i} for i in range(n)]
    )


def target_fraction(completion_ids, **kwargs):
    """The fraction of a completion's tokens that are TARGET_TOKEN."""
    return [sum(t == TARGET_TOKEN for t in ids) / len(ids) for ids in completion_ids]


def low_id_fraction(completion_ids, **kwargs):
    """The fraction of a completion's tokens with an id below 192 (about half of them for the random model)."""
    return [sum(t < 192 for t in ids) / len(ids) for ids in completion_ids]


def stopping_model(model_path: str, num_stops: int = 40):
    """The tiny model with many stop tokens, so that completions end early and differ in length."""
    model = AutoModelForCausalLM.from_pretrained(model_path)
    model.generation_config.eos_token_id = [model.generation_config.eos_token_id, *range(100, 100 + num_stops)]
    return model


class ParameterSnapshots(TrainerCallback):
    """Copies of the parameters after every optimizer step."""

    def __init__(self):
        self.after_step: list[dict[str, torch.Tensor]] = []

    def on_step_end(self, args, state, control, model=None, **kwargs):
        self.after_step.append({n: p.detach().clone() for n, p in model.named_parameters()})


def logged(trainer, key: str, step: int) -> float:
    return next(h[key] for h in trainer.state.log_history if h.get("step") == step and key in h)


def train(
    model_path_or_model,
    output_dir,
    reward=target_fraction,
    data=None,
    trainer_class=GRPOTrainer,
    config_class=GRPOConfig,
    callbacks=None,
    **overrides,
):
    trainer = trainer_class(
        model_path_or_model,
        reward,
        args=make_config(output_dir, config_class, **overrides),
        train_dataset=data if data is not None else prompt_dataset(),
        callbacks=callbacks,
    )
    trainer.train()
    return trainer


# -- batch arithmetic ----------------------------------------------------------------------------------------
def test_generation_batch_size_and_steps_per_generation_determine_each_other(tmp_path):
    """TRL's units: steps_per_generation counts micro-batches, its default is gradient_accumulation_steps."""
    config = make_config(tmp_path, per_device_train_batch_size=4, gradient_accumulation_steps=2, steps_per_generation=6)
    assert (config.generation_batch_size, config.optimizer_steps_per_generation) == (24, 3)
    config = make_config(
        tmp_path, per_device_train_batch_size=4, gradient_accumulation_steps=2, generation_batch_size=16
    )
    assert (config.steps_per_generation, config.optimizer_steps_per_generation) == (4, 2)
    config = make_config(tmp_path, gradient_accumulation_steps=3)
    assert (config.steps_per_generation, config.optimizer_steps_per_generation) == (3, 1)
    assert make_config(tmp_path).steps_per_generation == 1


@pytest.mark.parametrize(
    "overrides, message",
    [
        (
            dict(per_device_train_batch_size=6, num_generations=4),
            r"num_generations=4 must divide the 6 completions each process generates per round \(per_device_train_"
            r"batch_size 6 x steps_per_generation 1\).*Valid num_generations here: "
            r"\[2, 3, 6\]; .*steps_per_generation=2",
        ),
        (
            dict(per_device_train_batch_size=4, generation_batch_size=10),
            r"generation_batch_size=10 must be a multiple of per_device_train_batch_size \(4\) x processes "
            r"\(1\) = 4",
        ),
        (
            dict(per_device_train_batch_size=4, gradient_accumulation_steps=2, steps_per_generation=3),
            r"steps_per_generation=3 \(micro-batches per generation round, as in TRL\) must be a multiple of "
            r"gradient_accumulation_steps=2.*Valid values: 2, 4, 6, 8",
        ),
        (
            dict(per_device_train_batch_size=4, generation_batch_size=8, steps_per_generation=3),
            r"generation_batch_size=8 means steps_per_generation=2 .* but steps_per_generation=3 was set too",
        ),
        (
            dict(num_generations=1),
            r"num_generations=1, but GRPO needs at least 2 completions per prompt; its "
            r"advantages compare",
        ),
        (dict(loss_type="ppo"), r"loss_type='ppo' is not one of \('grpo', 'bnpo', 'dr_grpo', 'dapo', 'cispo', 'sapo'"),
        (dict(scale_rewards="std"), r"scale_rewards='std' is not one of"),
        (dict(importance_sampling_level="segment"), r"importance_sampling_level='segment' is not one of"),
        (dict(temperature=-0.5), r"temperature=-0.5 is invalid"),
        (dict(num_iterations=0), r"num_iterations=0 must be at least 1"),
        (dict(beta=-0.1), r"beta=-0.1 must be >= 0"),
        (dict(ds3_gather_for_generation=False), r"ds3_gather_for_generation.*DeepSpeed ZeRO-3"),
        (dict(vllm_tensor_parallel_size=2), r"vllm_tensor_parallel_size.*tensor parallelism needs several GPUs"),
        (dict(max_tool_calling_iterations=0), r"max_tool_calling_iterations=0: must be at least 1"),
        (dict(log_completions_hub_repo="me/completions"), r"log_completions_hub_repo.*Hugging Face Hub"),
        (dict(sync_ref_model=True), r"sync_ref_model=True updates the reference model, but beta=0"),
        (dict(beta=0.1, sync_ref_model=True, ref_model_mixup_alpha=0.0), r"ref_model_mixup_alpha=0.0 must lie in"),
        (dict(ref_model_sync_steps=0), r"ref_model_sync_steps=0 must be at least 1"),
        (dict(pad_to_multiple_of=0), r"pad_to_multiple_of=0 must be a positive int, 'auto' or None"),
        (
            dict(temperature=0.7, generation_kwargs={"temperature": 0.5}),
            r"generation_kwargs\['temperature'\]=0.5 disagrees with temperature=0.7",
        ),
        (dict(generation_kwargs={"max_new_tokens": 5}), r"disagrees with max_completion_length=8"),
        (dict(generation_kwargs={"seed": 3}), r"generation_kwargs\['seed'\] cannot be changed: each completion"),
        (dict(generation_kwargs={"num_beams": 2}), r"generation_kwargs\['num_beams'\] cannot be changed: beam search"),
        (dict(use_vllm=True, cache_implementation="static"), r"cache_implementation='static' sets up transformers'"),
        (dict(vllm_structured_outputs_regex="[ab]+"), r"vllm_structured_outputs_regex .* but use_vllm=False"),
        (dict(vllm_model_impl="torch"), r"vllm_model_impl='torch' is not one of \('vllm', 'transformers'\)"),
        (
            dict(use_vllm=True, vllm_mode="server", vllm_max_model_length=256),
            r"vllm_max_model_length=256 applies to colocated vLLM; .* -- --max-model-len",
        ),
        (dict(num_generations_eval=0), r"num_generations_eval=0 must be at least 1"),
        (dict(num_completions_to_print=0), r"num_completions_to_print=0 must be at least 1"),
        (
            dict(transformers_continuous_batching_config={"max_batch_tokens": 64}),
            r"use_transformers_continuous_batching=False; set it to True",
        ),
    ],
)
def test_bad_settings_fail_when_the_config_is_built(tmp_path, overrides, message):
    with pytest.raises(ConfigError, match=message):
        make_config(tmp_path, **overrides)


def test_generation_kwargs_keys_with_a_field_become_the_field(tmp_path, caplog):
    """TRL samples with generation_kwargs={"top_k": 5}: a key that is a config field of its own is taken as the
    field's value when the field is at its default (one info line), and is no longer a generation_kwargs key."""
    given = {"top_k": 5, "temperature": 0.5, "no_repeat_ngram_size": 3}
    with caplog.at_level("INFO", logger="posttrain"):
        config = make_config(tmp_path, generation_kwargs=given)
    assert (config.top_k, config.temperature) == (5, 0.5)
    assert config.generation_kwargs == {"no_repeat_ngram_size": 3} and config.sampling_params().top_k == 5
    assert given == {"top_k": 5, "temperature": 0.5, "no_repeat_ngram_size": 3}  # the caller's dict is untouched
    assert [r.getMessage() for r in caplog.records if "generation_kwargs" in r.getMessage()] == [
        "generation_kwargs keys with a config field of their own taken as top_k=5, temperature=0.5."
    ]
    same = make_config(tmp_path, max_completion_length=8, generation_kwargs={"max_new_tokens": 8})
    assert same.max_completion_length == 8 and same.generation_kwargs == {}


def test_reward_funcs_and_weights_are_trainer_attributes(tmp_path, tiny_model_path):
    """TRL's `trainer.reward_funcs` and `trainer.reward_weights` (as a tensor), in the order given."""
    trainer = GRPOTrainer(
        tiny_model_path,
        [target_fraction, low_id_fraction],
        args=make_config(tmp_path, reward_weights=[0.7, 0.3]),
        train_dataset=prompt_dataset(),
    )
    assert trainer.reward_funcs == [target_fraction, low_id_fraction]
    assert trainer.reward_weights.tolist() == pytest.approx([0.7, 0.3])


def test_rloo_needs_two_generations(tmp_path):
    with pytest.raises(ConfigError, match=r"num_generations=1, but RLOO needs at least 2 completions per prompt"):
        make_config(tmp_path, RLOOConfig, num_generations=1)


# -- errors at construction ------------------------------------------------------------------------------------
def needs_solution(completions, solution, **kwargs):
    return [0.0] * len(completions)


def add_numbers(a: int, b: int) -> int:
    """Adds two integers.

    Args:
        a: The first.
        b: The second.
    """
    return a + b


CONSTRUCTION_ERRORS = {
    "no prompt column": (
        dict(train_dataset=Dataset.from_list([{"question": "a", "answer": 1}] * 4)),
        DataError,
        r"needs a 'prompt' column .* columns \['question', 'answer'\]",
    ),
    "reward needs a missing column": (
        dict(reward_funcs=needs_solution),
        DataError,
        r"'needs_solution' has a required parameter 'solution' .*\(columns: \['answer'\]",
    ),
    "no reward functions": (dict(reward_funcs=[]), ConfigError, "No reward source provided .no reward functions given"),
    "no train_dataset": (dict(train_dataset=None), DataError, "`train_dataset` is required"),  # TRL's words
    "tools with text prompts": (
        dict(tools=[add_numbers]),
        DataError,
        r"tools= and environment_factory= need conversational prompts",
    ),
    "rollout_func with tools": (
        dict(rollout_func=len, tools=[add_numbers]),
        ConfigError,
        r"rollout_func samples the episodes itself; it cannot be combined with tools=",
    ),
    "eval set without a reward column": (
        dict(eval_dataset=Dataset.from_list([{"prompt": "a b"}] * 4)),
        DataError,
        r"eval_dataset lacks the columns \['answer'\] that train_dataset passes to the reward functions",
    ),
    "eval batch not a multiple of the eval group": (
        dict(eval_dataset=prompt_dataset(4)),
        ConfigError,
        r"per_device_eval_batch_size=8 .* must be a multiple of num_generations_eval=3",
    ),
    "missing prompt": (
        dict(train_dataset=Dataset.from_list([{"prompt": "a b"}, {"prompt": "c"}, {"prompt": None}])),
        DataError,
        r"Row 2, column 'prompt': expected a string like row 0, got None",
    ),
    "empty prompt": (
        dict(train_dataset=Dataset.from_list([{"prompt": "a b"}, {"prompt": ""}])),
        DataError,
        r"Row 1: the prompt is empty after tokenization",
    ),
}


@pytest.mark.parametrize("case", list(CONSTRUCTION_ERRORS))
def test_bad_input_fails_at_construction(case, tmp_path, tiny_model_path):
    overrides, error, message = CONSTRUCTION_ERRORS[case]
    inputs = {"reward_funcs": target_fraction, "train_dataset": prompt_dataset(), **overrides}
    with pytest.raises(error, match=message):
        GRPOTrainer(tiny_model_path, args=make_config(tmp_path, num_generations_eval=3), **inputs)


def test_a_tokenizer_without_eos_fails_at_construction(tmp_path, tiny_model_path, fresh_tokenizer):
    fresh_tokenizer.eos_token = None
    with pytest.raises(ConfigError, match="The tokenizer has no EOS token"):
        GRPOTrainer(
            tiny_model_path,
            target_fraction,
            args=make_config(tmp_path),
            train_dataset=prompt_dataset(),
            processing_class=fresh_tokenizer,
        )


def test_rewards_that_never_apply_stop_training_at_that_step(tmp_path, tiny_model_path):
    def not_applicable(completions, **kwargs):
        return [None] * len(completions)

    with pytest.raises(
        DataError,
        match=r"No reward function applies to this batch: not_applicable returned None "
        r"for all 8 samples",
    ):
        train(tiny_model_path, tmp_path, reward=not_applicable)


# -- pieces -------------------------------------------------------------------------------------------------
def test_sampler_gives_each_process_whole_contiguous_blocks_of_each_round():
    batches = {rank: list(RolloutSampler(10, 4, 2, rank, micro_steps_per_round=3, seed=1)) for rank in (0, 1)}
    assert all(len(b) == 2 * 3 for b in batches.values())  # 10 // 4 = 2 rounds, 3 micro-steps each
    order = torch.randperm(10, generator=torch.Generator().manual_seed(1)).tolist()
    for rank, rank_batches in batches.items():
        for i, batch in enumerate(rank_batches):
            round_index, micro_step = divmod(i, 3)
            slots = [2 * rank, 2 * rank + 1]
            assert batch == [(round_index, micro_step, s, order[4 * round_index + s]) for s in slots]
    sampler = RolloutSampler(10, 4, 1, 0, micro_steps_per_round=1, seed=1)
    sampler.set_epoch(1)
    second_epoch = [tag for batch in sampler for tag in batch]
    assert [t[0] for t in second_epoch] == [2] * 4 + [3] * 4  # rounds are numbered across epochs
    assert [t[3] for t in second_epoch] != order[:8]


def test_rollout_batches_drop_padding_no_row_of_the_slice_needs():
    rollout = Rollout(
        round=0,
        prompt_ids=torch.tensor([[0, 0, 5], [0, 6, 7], [8, 9, 10]]),
        prompt_mask=torch.tensor([[0, 0, 1], [0, 1, 1], [1, 1, 1]]),
        completion_ids=torch.tensor([[1, 0, 0], [2, 3, 0], [4, 5, 6]]),
        completion_mask=torch.tensor([[1, 0, 0], [1, 1, 0], [1, 1, 1]]),
        model_mask=torch.tensor([[1, 0, 0], [1, 1, 0], [1, 1, 1]]),
        loss_mask=torch.tensor([[1, 0, 0], [1, 1, 0], [0, 0, 0]]),
        finished=torch.tensor([True, True, False]),
        rewards=torch.tensor([1.0, 2.0, 3.0]),
        per_function_rewards=torch.tensor([[1.0], [2.0], [3.0]]),
        advantages=torch.tensor([0.1, 0.2, 0.3]),
        old_logps=torch.arange(9.0).view(3, 3),
    )
    batch = rollout.batch(0, 2)
    assert batch["prompt_ids"].tolist() == [[0, 5], [6, 7]] and batch["prompt_mask"].tolist() == [[0, 1], [1, 1]]
    assert batch["completion_ids"].tolist() == [[1, 0], [2, 3]]
    assert batch["loss_mask"].tolist() == [[1, 0], [1, 1]]
    assert batch["old_logps"].tolist() == [[0.0, 1.0], [3.0, 4.0]]
    assert batch["advantages"].tolist() == pytest.approx([0.1, 0.2])
    assert rollout.batch(2, 3)["prompt_ids"].tolist() == [[8, 9, 10]]


def test_groupwise_advantages_leave_out_unscored_completions():
    nan = float("nan")
    rewards = torch.tensor([1.0, nan, 3.0, 5.0, nan, nan, nan, 7.0, nan, 2.0, nan, 6.0], dtype=torch.float64)

    def centred(group):
        return group - group.mean()

    advantages = groupwise_advantages(rewards, 4, centred)
    # Scored: {1, 3, 5} (mean 3); {7} alone has no baseline, so all 0; {2, 6} (mean 4).
    assert advantages.tolist() == [-2.0, 0.0, 0.0, 2.0, 0.0, 0.0, 0.0, 0.0, 0.0, -2.0, 0.0, 2.0]


# -- prompts, reward inputs, metrics --------------------------------------------------------------------------
def test_conversational_prompts_and_reward_inputs(tmp_path, tiny_model_path, tokenizer):
    rows = [
        {
            "prompt": [{"role": "system", "content": "be brief"}, {"role": "user", "content": f"count {i}"}],
            "answer": i,
            "topic": "numbers",
        }
        for i in range(4)
    ]
    seen = {}

    def recording_reward(prompts, completions, completion_ids, answer, topic, trainer_state, **kwargs):
        seen.update(
            prompts=prompts,
            completions=completions,
            completion_ids=completion_ids,
            answer=answer,
            topic=topic,
            step=trainer_state.global_step,
            extra=sorted(kwargs),
        )
        return [float(a) for a in answer]

    trainer = train(
        tiny_model_path, tmp_path, reward=recording_reward, data=Dataset.from_list(rows), max_prompt_length=12
    )
    rendered = [tokenizer.apply_chat_template(r["prompt"], tokenize=False, add_generation_prompt=True) for r in rows]
    full_ids = [tokenizer(text, add_special_tokens=False)["input_ids"] for text in rendered]
    assert trainer.train_dataset["prompt_ids"] == [ids[-12:] for ids in full_ids]
    assert all(len(ids) > 12 for ids in full_ids)  # truncation kept the end, with the generation prompt

    order = [seen["answer"][4 * g] for g in range(2)]
    assert seen["answer"] == [a for a in order for _ in range(4)]  # each prompt's row repeated per generation
    assert seen["prompts"] == [rows[a]["prompt"] for a in seen["answer"]]
    assert (
        seen["topic"] == ["numbers"] * 8 and seen["step"] == 0 and seen["extra"] == ["log_extra", "log_metric"]
    )  # TRL's logging hooks
    rollout = trainer.rollout
    for i, completion in enumerate(seen["completions"]):
        ids = rollout.completion_ids[i][rollout.completion_mask[i].bool()].tolist()
        assert seen["completion_ids"][i] == ids
        assert completion == [{"role": "assistant", "content": tokenizer.decode(ids, skip_special_tokens=True)}]
        prompt = rollout.prompt_ids[i][rollout.prompt_mask[i].bool()].tolist()
        assert prompt == full_ids[seen["answer"][i]][-12:]


def test_round_metrics_and_completion_log(tmp_path, tiny_model_path, tokenizer):
    def length_reward(completion_ids, **kwargs):
        return [float(len(ids)) for ids in completion_ids]

    model = stopping_model(tiny_model_path)
    initial = copy.deepcopy(model)
    trainer = train(
        model,
        tmp_path,
        reward=[length_reward, target_fraction],
        reward_weights=[1.0, 10.0],
        log_completions=True,
        mask_truncated_completions=True,
    )
    rollout = trainer.rollout
    lengths = rollout.completion_mask.sum(1).double()
    finished = rollout.finished
    assert 0 < finished.sum() < 8 and lengths.min() < lengths.max()  # the test needs both kinds and lengths
    ids = [rollout.completion_ids[i][: int(lengths[i])].tolist() for i in range(8)]
    fractions = torch.tensor(target_fraction(ids), dtype=torch.float64)
    rewards = lengths + 10 * fractions
    groups = rewards.view(2, 4)
    advantages = ((groups - groups.mean(1, keepdim=True)) / (groups.std(1, keepdim=True) + 1e-4)).view(-1)

    expected = {
        "reward": rewards.mean(),
        "reward_std": rewards.std(),
        "frac_reward_none": 0.0,
        "rewards/length_reward/mean": lengths.mean(),
        "rewards/length_reward/std": lengths.std(),
        "rewards/target_fraction/mean": fractions.mean(),
        "rewards/target_fraction/std": fractions.std(),
        "advantages/mean": advantages.mean(),
        "advantages/std": advantages.std(),
        "completions/mean_length": lengths.mean(),
        "completions/min_length": lengths.min(),
        "completions/max_length": lengths.max(),
        "completions/clipped_ratio": 1 - finished.double().mean(),
        "completions/mean_terminated_length": lengths[finished].mean(),
        "completions/min_terminated_length": lengths[finished].min(),
        "completions/max_terminated_length": lengths[finished].max(),
        "num_tokens": rollout.prompt_mask.sum() + lengths.sum(),
    }
    for key, value in expected.items():
        assert logged(trainer, key, 1) == pytest.approx(float(value), abs=1e-5), key
    assert torch.allclose(rollout.advantages.double(), advantages, atol=1e-5)
    assert torch.equal(rollout.loss_mask, rollout.completion_mask * finished[:, None])
    for key in ("time/generation", "time/scoring", "time/update"):
        assert 0 < logged(trainer, key, 1) < 600
    # One pass over freshly generated completions: every ratio is exactly 1, so nothing is clipped.
    assert logged(trainer, "clip_ratio/region_mean", 1) == 0.0
    # Entropy of the policy before its update over the trained tokens, in float64.
    mask = torch.cat([rollout.prompt_mask, rollout.completion_mask], 1)
    with torch.no_grad():
        logits = initial.double()(
            input_ids=torch.cat([rollout.prompt_ids, rollout.completion_ids], 1),
            attention_mask=mask,
            position_ids=(mask.cumsum(1) - 1).clamp(min=0),
        ).logits
    width = rollout.prompt_ids.shape[1]
    logps = logits[:, width - 1 : -1].log_softmax(-1)
    entropy = -(logps.exp() * logps).sum(-1)
    trained = rollout.loss_mask.double()
    assert logged(trainer, "entropy", 1) == pytest.approx(float((entropy * trained).sum() / trained.sum()), rel=1e-4)
    assert "kl" not in trainer.state.log_history[0]  # beta = 0: no reference

    records = [json.loads(line) for line in (tmp_path / "completions.jsonl").read_text().splitlines()]
    assert len(records) == 8
    for record, completion, reward in zip(records, ids, rewards.tolist()):
        assert record["step"] == 0 and isinstance(record["prompt"], str)
        assert record["completion"] == tokenizer.decode(completion, skip_special_tokens=True)
        assert record["reward"] == pytest.approx(reward, abs=1e-5)


# -- reproducibility and split invariance --------------------------------------------------------------------
def test_same_seed_same_completions_and_losses(tmp_path, tiny_model_path):
    runs = [
        train(tiny_model_path, tmp_path / name, max_steps=3, seed=seed) for name, seed in (("a", 0), ("b", 0), ("c", 1))
    ]
    losses = [[logged(t, "loss", s) for s in (1, 2, 3)] for t in runs]
    assert torch.equal(runs[0].rollout.completion_ids, runs[1].rollout.completion_ids)
    assert losses[0] == losses[1]
    assert not torch.equal(runs[0].rollout.completion_ids, runs[2].rollout.completion_ids)


def _first_update(model_path, output_dir, **overrides):
    """Parameters after one plain SGD step (no clipping), so that they are initial - lr * gradient."""
    snapshots = ParameterSnapshots()
    trainer = train(
        stopping_model(model_path),
        output_dir,
        reward=low_id_fraction,
        callbacks=[snapshots],
        optim="sgd",
        learning_rate=1.0,
        lr_scheduler_type="constant",
        max_grad_norm=0.0,
        **overrides,
    )
    return trainer, snapshots.after_step[0]


@pytest.mark.parametrize("loss_type", ["grpo", "bnpo"])
def test_micro_batch_split_does_not_change_the_first_update(tmp_path, tiny_model_path, loss_type):
    whole, expected = _first_update(tiny_model_path, tmp_path / "whole", loss_type=loss_type)
    lengths = whole.rollout.completion_mask.sum(1)
    assert lengths[:4].sum() != lengths[4:].sum()  # halves differ, so per-micro-batch normalising would show
    split, params = _first_update(
        tiny_model_path,
        tmp_path / "split",
        loss_type=loss_type,
        per_device_train_batch_size=4,
        gradient_accumulation_steps=2,
    )
    assert torch.equal(whole.rollout.completion_ids, split.rollout.completion_ids)
    assert logged(split, "loss", 1) == pytest.approx(logged(whole, "loss", 1), abs=1e-6)
    initial = AutoModelForCausalLM.from_pretrained(tiny_model_path).state_dict()
    assert max((expected[n] - initial[n]).abs().max() for n in expected) > 1e-3
    for name, value in params.items():
        torch.testing.assert_close(value, expected[name], atol=1e-6, rtol=0)


def test_steps_per_generation_does_not_change_the_first_update(tmp_path, tiny_model_path):
    one, expected = _first_update(tiny_model_path, tmp_path / "one")
    two, params = _first_update(tiny_model_path, tmp_path / "two", steps_per_generation=2)
    # The first optimizer step of the larger round trains on the same 8 completions (with old log-probs).
    assert torch.equal(
        two.rollout.completion_ids[:8, : one.rollout.completion_ids.shape[1]], one.rollout.completion_ids
    )
    assert len(two.rollout) == 16 and two.rollout.old_logps is not None and one.rollout.old_logps is None
    for name, value in params.items():
        torch.testing.assert_close(value, expected[name], atol=1e-6, rtol=0)


# -- options ------------------------------------------------------------------------------------------------
def test_shuffle_dataset_false_keeps_the_dataset_order(tmp_path, tiny_model_path):
    assert [t[3] for b in RolloutSampler(6, 2, 1, 0, 1, seed=3, shuffle=False) for t in b] == list(range(6))
    seen = []

    def record_answers(completions, answer, **kwargs):
        seen.append(list(answer))
        return [0.0] * len(completions)

    train(tiny_model_path, tmp_path / "ordered", reward=record_answers, shuffle_dataset=False, max_steps=2)
    assert seen == [[0] * 4 + [1] * 4, [2] * 4 + [3] * 4]
    train(tiny_model_path, tmp_path / "shuffled", reward=record_answers, max_steps=2)
    order = torch.randperm(16, generator=torch.Generator().manual_seed(0)).tolist()  # seed=0, epoch 0
    assert seen[2:] == [[order[0]] * 4 + [order[1]] * 4, [order[2]] * 4 + [order[3]] * 4]


def test_pad_to_multiple_of_pads_the_batches_without_changing_the_loss(tmp_path, tiny_model_path):
    plain = train(stopping_model(tiny_model_path), tmp_path / "plain", reward=low_id_fraction)
    padded = train(stopping_model(tiny_model_path), tmp_path / "padded", reward=low_id_fraction, pad_to_multiple_of=16)
    assert plain.rollout.completion_ids.shape[1] % 16 and plain.rollout.prompt_ids.shape[1] % 16
    for rollout in (padded.rollout, padded.rollout.batch(0, 4)):
        widths = (
            [rollout["completion_ids"].shape[1], rollout["prompt_ids"].shape[1]]
            if isinstance(rollout, dict)
            else [rollout.completion_ids.shape[1], rollout.prompt_ids.shape[1]]
        )
        assert all(w % 16 == 0 for w in widths), widths
    assert logged(padded, "loss", 1) == pytest.approx(logged(plain, "loss", 1), abs=1e-6)
    assert plain.pad_multiple is None  # "auto": no padding off Neuron


def test_chat_template_kwargs_reach_the_template(tmp_path, tiny_model_path, fresh_tokenizer):
    fresh_tokenizer.chat_template = (
        "{% for m in messages %}{{ m['content'] }}{% endfor %}{{ ' mood ' + (mood or 'none') }}"
    )
    data = Dataset.from_list([{"prompt": [{"role": "user", "content": f"cat {i}"}]} for i in range(4)])
    trainer = GRPOTrainer(
        tiny_model_path,
        target_fraction,
        train_dataset=data,
        processing_class=fresh_tokenizer,
        args=make_config(tmp_path, chat_template_kwargs='{"mood": "sunny"}'),
    )
    assert fresh_tokenizer.decode(trainer.train_dataset[0]["prompt_ids"]) == "cat 0 mood sunny"


def test_disable_dropout_switches_the_policys_dropout_off(tmp_path, tiny_model_path):
    def with_dropout():
        model = AutoModelForCausalLM.from_pretrained(tiny_model_path)
        model.model.extra_dropout = torch.nn.Dropout(0.5)
        return model

    for disable, p in ((True, 0.0), (False, 0.5)):
        trainer = GRPOTrainer(
            with_dropout(),
            target_fraction,
            train_dataset=prompt_dataset(),
            args=make_config(tmp_path, disable_dropout=disable),
        )
        assert trainer.model.model.extra_dropout.p == p


def test_sync_ref_model_mixes_the_policy_into_the_reference(tmp_path, tiny_model_path):
    snapshots = ParameterSnapshots()
    trainer = train(
        stopping_model(tiny_model_path),
        tmp_path,
        reward=low_id_fraction,
        callbacks=[snapshots],
        max_steps=3,
        beta=0.1,
        sync_ref_model=True,
        ref_model_mixup_alpha=0.3,
        ref_model_sync_steps=2,
    )
    reference = {n: p.double() for n, p in AutoModelForCausalLM.from_pretrained(tiny_model_path).named_parameters()}
    policy = {n: p.double() for n, p in snapshots.after_step[1].items()}  # the reference mixes at step 2 only
    expected = {n: 0.3 * policy[n] + 0.7 * reference[n] for n in reference}
    moved = max((expected[n] - reference[n]).abs().max() for n in reference)
    assert moved > 1e-4
    for name, value in trainer.ref_model.named_parameters():
        torch.testing.assert_close(value.double(), expected[name], atol=1e-6, rtol=0)


def test_evaluation_generates_for_every_eval_prompt_and_logs_eval_rewards(tmp_path, tiny_model_path):
    calls = []

    def recorded(prompts, completion_ids, trainer_state, **kwargs):
        rewards = low_id_fraction(completion_ids)
        calls.append((list(prompts), rewards))
        return rewards

    eval_data = prompt_dataset(5)
    trainer = GRPOTrainer(
        tiny_model_path,
        recorded,
        train_dataset=prompt_dataset(),
        eval_dataset=eval_data,
        args=make_config(tmp_path, num_generations_eval=2, per_device_eval_batch_size=4),
    )
    metrics = trainer.evaluate()
    # 5 prompts, 2 per round (4 completions / 2): 3 rounds, the last one filled up with prompt 0 again.
    prompts = [p for call in calls for p in call[0]]
    assert prompts == [p for p in list(eval_data["prompt"]) + [eval_data[0]["prompt"]] for _ in range(2)]
    rewards = torch.tensor([r for call in calls for r in call[1]], dtype=torch.float64)
    assert metrics["eval_reward"] == pytest.approx(float(rewards.view(3, 4).mean(1).mean()), abs=1e-6)
    assert metrics["eval_rewards/recorded/mean"] == pytest.approx(metrics["eval_reward"], abs=1e-6)
    assert math.isfinite(metrics["eval_loss"]) and "eval_completions/mean_length" in metrics
    assert trainer.evaluate()["eval_reward"] == metrics["eval_reward"]  # eval sampling is seeded
    assert trainer.state.log_history[-1]["eval_reward"] == metrics["eval_reward"]

    calls.clear()
    trainer = GRPOTrainer(
        tiny_model_path,
        recorded,
        train_dataset=prompt_dataset(),
        eval_dataset=eval_data,
        args=make_config(
            tmp_path / "during",
            num_generations_eval=2,
            per_device_eval_batch_size=4,
            eval_strategy="steps",
            eval_steps=1,
        ),
    )
    trainer.train()
    assert len(calls) == 1 + 3 and "eval_reward" in trainer.state.log_history[-2]


def test_eval_dataset_is_kept_as_given_and_prepared_once(tmp_path, tiny_model_path, monkeypatch):
    # TRL's online trainers keep `eval_dataset` as given; posttrain tokenizes its prompts at the first evaluate().
    eval_data = prompt_dataset(4)
    trainer = GRPOTrainer(
        tiny_model_path,
        low_id_fraction,
        train_dataset=prompt_dataset(),
        eval_dataset={"a": eval_data, "b": prompt_dataset(2)},
        args=make_config(tmp_path, per_device_eval_batch_size=4),
    )
    assert trainer.eval_dataset["a"] is eval_data and "prompt_ids" not in eval_data.column_names
    prepared = []
    real = trainer.prepare_dataset
    monkeypatch.setattr(trainer, "prepare_dataset", lambda d, *a: prepared.append(d) or real(d, *a))
    first = trainer.evaluate()
    second = trainer.evaluate()
    assert second["eval_a_reward"] == first["eval_a_reward"]  # eval sampling is seeded
    assert [d is eval_data for d in prepared].count(True) == 1 and len(prepared) == 2  # once per set, not per call
    assert "eval_a_reward" in first and "eval_b_reward" in first
    single = GRPOTrainer(
        tiny_model_path,
        low_id_fraction,
        train_dataset=prompt_dataset(),
        eval_dataset=eval_data,
        args=make_config(tmp_path / "single", per_device_eval_batch_size=4),
    )
    assert single.eval_dataset is eval_data and math.isfinite(single.evaluate()["eval_reward"])


def test_log_completions_prints_the_chosen_sample(tmp_path, tiny_model_path, capsys, monkeypatch):
    import posttrain.online.evaluation as online_eval

    printed_records = []
    real = online_eval.print_completion_table
    monkeypatch.setattr(
        online_eval,
        "print_completion_table",
        lambda records, *a, **k: (printed_records.append(records), real(records, *a, **k)),
    )
    train(tiny_model_path, tmp_path, log_completions=True, num_completions_to_print=3)
    printed = capsys.readouterr().out
    assert "Completions at step 1" in printed and "target_fraction" in printed and len(printed_records[-1]) == 3
    logged = [json.loads(line) for line in (tmp_path / "completions.jsonl").read_text().splitlines()]
    for record in printed_records[-1]:  # each printed row is a logged completion, with its per-function reward
        assert record in logged and record["rewards"]["target_fraction"] == record["reward"]
    train(tiny_model_path, tmp_path / "unique", log_completions=True, log_unique_prompts=True)
    assert len(printed_records[-1]) == 2  # 2 prompts x 4 completions, each prompt once


def test_options_match_trl_defaults_and_signatures(tmp_path):
    import inspect

    from posttrain.trainers.rloo import RLOOTrainer

    surface = json.loads((REPO_ROOT / "tests" / "fixtures" / "trl_1.16_surface.json").read_text())
    for ours in (GRPOConfig, RLOOConfig):
        defaults = surface["configs"][ours.__name__]
        for name in (
            "max_completion_length",
            "min_p",
            "vllm_mode",
            "vllm_server_host",
            "vllm_server_timeout",
            "shuffle_dataset",
            "pad_to_multiple_of",
            "num_generations",
            "beta",
            "ref_model_mixup_alpha",
            "ref_model_sync_steps",
            "vllm_model_impl",
            "vllm_group_port",
            "num_generations_eval",
        ):
            assert getattr(ours(output_dir=str(tmp_path)), name) == defaults[name], (ours.__name__, name)
    for ours in (GRPOTrainer, RLOOTrainer):
        trl = surface["trainers"][ours.__name__]
        assert list(inspect.signature(ours).parameters)[: len(trl)] == trl  # posttrain's extras come after


# -- two processes ---------------------------------------------------------------------------------------------
def one_step_record(model_path: str, out_dir: str, per_device: int) -> dict:
    """One SGD step with batch-scaled rewards (which need every process's rewards); what each process saw."""
    trainer, params = _first_update(
        model_path, out_dir, per_device_train_batch_size=per_device, scale_rewards="batch", ddp_backend="gloo"
    )
    rollout = trainer.rollout
    return {
        "rank": trainer.args.process_index,
        "world_size": trainer.accelerator.num_processes,
        "completion_ids": [
            rollout.completion_ids[i][rollout.completion_mask[i].bool()].tolist() for i in range(len(rollout))
        ],
        "advantages": rollout.advantages,
        "loss": logged(trainer, "loss", 1),
        "reward_std": logged(trainer, "reward_std", 1),
        "params": params,
    }


@pytest.mark.slow
def test_two_processes_match_one_process(tmp_path, tiny_model_path):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=subprocess_pythonpath())
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node",
        "2",
        __file__,
        tiny_model_path,
        str(tmp_path / "ddp"),
        "4",
    ]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    ranks = [torch.load(tmp_path / "ddp" / f"rank{r}.pt") for r in range(2)]
    single = one_step_record(tiny_model_path, str(tmp_path / "single"), 8)

    assert [r["world_size"] for r in ranks] == [2, 2] and single["world_size"] == 1
    assert ranks[0]["completion_ids"] + ranks[1]["completion_ids"] == single["completion_ids"]
    torch.testing.assert_close(torch.cat([r["advantages"] for r in ranks]), single["advantages"], atol=1e-6, rtol=0)
    # Batch scaling divides by the std of all 8 rewards; one process's 4 would give other advantages.
    local_std = torch.tensor(low_id_fraction(single["completion_ids"][:4])).std().item()
    assert abs(local_std - single["reward_std"]) > 1e-3
    for rank in ranks:
        assert rank["loss"] == pytest.approx(single["loss"], abs=1e-6)
        assert rank["reward_std"] == pytest.approx(single["reward_std"], abs=1e-6)
        for name, value in single["params"].items():
            torch.testing.assert_close(rank["params"][name], value, atol=1e-6, rtol=0)


if __name__ == "__main__":
    model_path, out_dir, per_device = sys.argv[1], sys.argv[2], int(sys.argv[3])
    record = one_step_record(model_path, out_dir, per_device)
    assert record["world_size"] == int(os.environ.get("WORLD_SIZE", "1")) == 2, record["world_size"]
    os.makedirs(out_dir, exist_ok=True)
    torch.save(record, os.path.join(out_dir, f"rank{record['rank']}.pt"))


def test_reward_functions_log_their_own_metrics_through_log_metric(tmp_path, tiny_model_path):
    seen = []

    def reward(completion_ids, log_metric, **kwargs):  # TRL's argument, asked for by name
        lengths = [len(ids) for ids in completion_ids]
        log_metric("mean_ids", sum(lengths) / len(lengths))
        seen.append(sum(lengths) / len(lengths))
        return [float(n) for n in lengths]

    trainer = train(tiny_model_path, tmp_path, reward=reward, max_steps=2, logging_steps=1)
    logged = [h["mean_ids"] for h in trainer.state.log_history if "mean_ids" in h and "train_loss" not in h]
    assert len(seen) == 2 and logged == pytest.approx(seen)  # one round per step, logged at each step


def test_log_extra_columns_reach_the_completion_log(tmp_path, tiny_model_path):
    def reward(completions, completion_ids, log_extra, **kwargs):  # TRL's argument
        log_extra("n_ids", [len(ids) for ids in completion_ids])
        return [float(len(ids)) for ids in completion_ids]

    train(tiny_model_path, tmp_path, reward=reward, max_steps=1, log_completions=True)
    records = [json.loads(line) for line in (tmp_path / "completions.jsonl").read_text().splitlines()]
    assert records and all(r["extra"]["n_ids"] == r["reward"] for r in records)
