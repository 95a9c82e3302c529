"""Runs TRL accepts that posttrain used to refuse: greedy rollouts (generation_kwargs={"do_sample": False} or
temperature=0) with the sampler correction off, a train set smaller than one generation round, SDFT/SDPO generation
rounds of several optimizer steps, IW-OPD's teacher server, and a reward model whose config has no pad or eos
token id. Each is checked against an independent computation (transformers' greedy generate, the float rule)."""

from __future__ import annotations

import logging
import math

import pytest
import torch
from datasets import Dataset
from test_engine import make_config, prompt_dataset
from test_sdft_sdpo import _kw, _sdft_data
from test_server_distillation import _data, _teacher, _TeacherHandler, teacher_url  # noqa: F401 (fixture)
from transformers import AutoModelForCausalLM, AutoTokenizer

from posttrain import RewardConfig, RewardTrainer
from posttrain.errors import ConfigError
from posttrain.experimental.iw_opd import IWOPDConfig, IWOPDTrainer
from posttrain.experimental.sdft import SDFTConfig, SDFTTrainer
from posttrain.models.tiny import build_tiny_model
from posttrain.trainers.grpo import GRPOTrainer
from posttrain.trainers.self_distillation_rounds import rollout_weights


# -- greedy rollouts ---------------------------------------------------------------------------------------------
def _recording_reward(seen: list):
    def reward(prompts, completion_ids, **kwargs):
        seen.append((list(prompts), [list(ids) for ids in completion_ids]))
        return [float(len(ids)) for ids in completion_ids]

    return reward


@pytest.mark.parametrize("greedy", [dict(generation_kwargs={"do_sample": False}), dict(temperature=0.0)])
def test_greedy_rollouts_are_transformers_greedy_decoding(tiny_model_path, tmp_path, greedy):
    config = make_config(tmp_path, num_generations=2, per_device_train_batch_size=4, **greedy)
    assert config.greedy and not config.vllm_importance_sampling_correction
    assert config.logps_temperature == 1.0
    seen = []
    trainer = GRPOTrainer(tiny_model_path, _recording_reward(seen), args=config, train_dataset=prompt_dataset(8))
    reference = AutoModelForCausalLM.from_pretrained(tiny_model_path)  # the weights round 0 is sampled with
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_path)
    trainer.train()
    prompts, completions = seen[0]
    for prompt, ours in zip(prompts, completions):
        ids = tokenizer(prompt, return_tensors="pt")["input_ids"]
        out = reference.generate(ids, max_new_tokens=8, do_sample=False, pad_token_id=tokenizer.pad_token_id)
        theirs = out[0, ids.shape[1] :].tolist()
        assert ours == theirs[: len(ours)] and (len(ours) == 8 or ours[-1] == tokenizer.eos_token_id)
    assert completions[0] == completions[1] and completions[2] == completions[3]  # a group is one arg-max


def test_greedy_rollouts_carry_no_sampler_log_probs(tiny_model_path, tmp_path):
    config = make_config(tmp_path, num_generations=2, generation_kwargs={"do_sample": False, "no_repeat_ngram_size": 2})
    trainer = GRPOTrainer(tiny_model_path, _recording_reward([]), args=config, train_dataset=prompt_dataset(8))
    rows = [trainer.train_dataset[i] for i in range(4)]
    rollout = trainer.make_rollout(rows, list(range(4)), 0)
    assert rollout.sampler_logps is None
    assert config.sampling_params().extra == {"no_repeat_ngram_size": 2}
    with pytest.raises(ConfigError, match=r"temperature=-0.5 is invalid"):
        make_config(tmp_path, temperature=-0.5)


# -- a train set smaller than one round --------------------------------------------------------------------------
def test_a_partial_round_trains_on_every_prompt(tiny_model_path, tmp_path, caplog):
    seen = []
    config = make_config(tmp_path, per_device_train_batch_size=8, num_generations=2, max_steps=2)  # 4 prompts a round
    with caplog.at_level(logging.WARNING, logger="posttrain"):
        trainer = GRPOTrainer(tiny_model_path, _recording_reward(seen), args=config, train_dataset=prompt_dataset(3))
    assert "has 3 prompts, fewer than the 4 of one generation round" in caplog.text
    trainer.train()
    assert trainer.state.global_step == 2
    for prompts, _ in seen:
        distinct = set(prompts)
        assert len(prompts) == 8 and distinct == set(prompt_dataset(3)["prompt"])


# -- SDFT / SDPO generation rounds -------------------------------------------------------------------------------
def test_sdft_rounds_resolve_as_trl(tmp_path):
    from _trl import import_trl_experimental

    theirs = import_trl_experimental("sdft").SDFTConfig
    for settings in (
        dict(gradient_accumulation_steps=2, steps_per_generation=4),
        dict(gradient_accumulation_steps=2, generation_batch_size=16),
        dict(gradient_accumulation_steps=2),
        dict(gradient_accumulation_steps=3, steps_per_generation=2),
        dict(per_device_train_batch_size=1, generation_batch_size=2),
    ):
        trl_config = theirs(**_kw(tmp_path, **settings))
        ours = SDFTConfig(**_kw(tmp_path, **settings))
        assert (ours.steps_per_generation, ours.generation_batch_size) == (
            trl_config.steps_per_generation,
            trl_config.generation_batch_size,
        )
    with pytest.raises(
        ConfigError, match=r"per_device_train_batch_size x steps_per_generation \(3\) must be a multiple"
    ):
        SDFTConfig(**_kw(tmp_path, per_device_train_batch_size=1, steps_per_generation=3))


def test_sdft_round_of_two_steps_is_sampled_at_its_first_step(tmp_path, tokenizer):
    trainer = SDFTTrainer(
        build_tiny_model(tokenizer),
        args=SDFTConfig(**_kw(tmp_path, steps_per_generation=2, max_steps=4)),
        train_dataset=_sdft_data(8),
        processing_class=tokenizer,
    )
    sampled_at, generate = [], trainer._sampler.generate

    def recording(*args, **kwargs):
        sampled_at.append(trainer.state.global_step)
        return generate(*args, **kwargs)

    trainer._sampler.generate = recording
    trainer.train()
    assert trainer.state.global_step == 4
    assert sorted(set(sampled_at)) == [0, 2]  # rounds start at steps 0 and 2; steps 1 and 3 reuse them


def test_sdft_rounds_that_straddle_optimizer_steps_keep_their_log_probs(tmp_path, tokenizer):
    """gradient_accumulation_steps=3, steps_per_generation=2: step 0 samples two rounds (one micro-batch left
    over), step 1 one more; each micro-batch has its own seed and its log-probs at sampling."""
    trainer = SDFTTrainer(
        build_tiny_model(tokenizer),
        args=SDFTConfig(
            **_kw(
                tmp_path,
                per_device_train_batch_size=2,
                gradient_accumulation_steps=3,
                steps_per_generation=2,
                max_steps=2,
            )
        ),
        train_dataset=_sdft_data(8),
        processing_class=tokenizer,
    )
    sampled, generate = [], trainer._sampler.generate

    def recording(prompt_ids, n, sampling, seed=None):
        sampled.append((trainer.state.global_step, tuple(seed) if isinstance(seed, list) else seed))
        return generate(prompt_ids, n, sampling, seed=seed)

    trainer._sampler.generate = recording
    taken, take = [], trainer._rounds.take

    def recording_take(*args, **kwargs):
        batches, count = take(*args, **kwargs)
        taken.append(all("old_logps" in b for b in batches))
        return batches, count

    trainer._rounds.take = recording_take
    trainer.train()
    assert [step for step, _ in sampled] == [0, 0, 0, 0, 1, 1]
    assert len({seed for _, seed in sampled}) == 6 and taken == [True, True]


def test_rollout_weights_are_the_clipped_ratio():
    logps = torch.tensor([[-1.0, -2.0, -0.5]], dtype=torch.float64)
    old = torch.tensor([[-1.5, -1.0, -30.0]], dtype=torch.float64)
    expected = [min(2.718281828459045**0.5, 2.0), 2.718281828459045**-1.0, 2.0]
    assert rollout_weights(logps, old, 2.0)[0].tolist() == pytest.approx(expected)


# -- IW-OPD's teacher server -------------------------------------------------------------------------------------
def _iw_opd(tmp_path, tokenizer, **settings):
    base = dict(
        output_dir=str(tmp_path),
        per_device_train_batch_size=4,
        max_steps=1,
        report_to="none",
        use_cpu=True,
        seed=0,
        max_length=64,
        max_completion_length=8,
        disable_tqdm=True,
        save_strategy="no",
    )
    return IWOPDConfig(**{**base, **settings})


@pytest.mark.parametrize("objective", ["iw_opd", "jsd"])
def test_iw_opd_scores_with_the_teacher_server_as_with_the_same_teacher_loaded(
    tmp_path, tokenizer, teacher_url, objective
):
    data = _data(4)
    settings = dict(distillation_objective=objective, beta=0.0, loss_top_k=0 if objective == "jsd" else 1)
    student = build_tiny_model(tokenizer, seed=3)
    local = IWOPDTrainer(
        student,
        _TeacherHandler.model,
        args=_iw_opd(tmp_path, tokenizer, **settings),
        train_dataset=data,
        processing_class=tokenizer,
    )
    served = IWOPDTrainer(
        build_tiny_model(tokenizer, seed=3),
        args=_iw_opd(
            tmp_path,
            tokenizer,
            use_teacher_server=True,
            teacher_model_server_url=teacher_url,
            **{**settings, "loss_top_k": 1},
        ),
        train_dataset=data,
        processing_class=tokenizer,
    )
    assert served.teacher_model is None and served.teacher_server is not None
    batch = local._student_batch(local.data_collator([local.train_dataset[i] for i in range(4)]), 7, "train")
    assert (batch["labels"] != -100).sum() > 4  # on-policy completions to score
    inputs = {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"]}
    with torch.no_grad():
        ours = served._forward_nll(served.model, inputs, batch["labels"])[0]
        if objective == "iw_opd":  # the same teacher log-probs of the sampled tokens, served or local
            theirs = local._forward_nll(local.model, inputs, batch["labels"])[0]
            assert ours.item() == pytest.approx(theirs.item(), rel=1e-5)
        else:  # forward KL on the teacher's top-1 with the rest as a tail: the sparse rule of ServerDistillation
            assert ours.item() == pytest.approx(_sparse_top1_reference(served.model, batch), rel=1e-5)
    with pytest.raises(ConfigError, match=r"use_teacher_server=True scores with the teacher at"):
        IWOPDTrainer(
            build_tiny_model(tokenizer),
            _TeacherHandler.model,
            args=_iw_opd(tmp_path, tokenizer, use_teacher_server=True, teacher_model_server_url=teacher_url),
            train_dataset=data,
            processing_class=tokenizer,
        )


def _sparse_top1_reference(student, batch) -> float:
    """Float64: per trained position, KL([q, 1 - q] || [p, 1 - p]) on the teacher's most likely token."""
    total = 0.0
    with torch.no_grad():
        s_all = student(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits.double()
        for row in range(len(batch["input_ids"])):
            n = int(batch["attention_mask"][row].sum())
            ids = batch["input_ids"][row, :n]
            t_all = _TeacherHandler.model(ids[None]).logits[0].double().log_softmax(-1)
            s_row = s_all[row].log_softmax(-1)
            for j in range(1, n):
                if batch["labels"][row, j] != -100:
                    top = int(t_all[j - 1].argmax())
                    q, p = t_all[j - 1, top].exp().item(), s_row[j - 1, top].exp().item()
                    total += q * math.log(q / p) + (1 - q) * math.log((1 - q) / (1 - p))
    return total


# -- the reward model's pad token --------------------------------------------------------------------------------
def test_reward_model_takes_its_pad_token_from_the_tokenizer_of_the_same_id(tmp_path, tokenizer):
    model = build_tiny_model(tokenizer)
    model.config.pad_token_id = model.config.eos_token_id = model.config.bos_token_id = None
    model.generation_config.pad_token_id = model.generation_config.eos_token_id = None
    model.generation_config.bos_token_id = None
    path = tmp_path / "no-pad-id"
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    rows = [{"prompt": "the sky is", "chosen": " blue" * (1 + i % 3), "rejected": " red"} for i in range(8)]
    args = RewardConfig(
        output_dir=str(tmp_path / "out"), max_steps=1, report_to="none", use_cpu=True, save_strategy="no"
    )
    trainer = RewardTrainer(str(path), args=args, train_dataset=Dataset.from_list(rows))
    assert trainer.model.config.pad_token_id == tokenizer.pad_token_id is not None
    trainer.model.eval()
    short, long = tokenizer("the sky is blue")["input_ids"], tokenizer("the sky is blue blue blue")["input_ids"]
    padded = torch.tensor([short + [tokenizer.pad_token_id] * (len(long) - len(short)), long])
    with torch.no_grad():
        batch = trainer.model(padded, attention_mask=(padded != tokenizer.pad_token_id).long()).logits[:, 0]
        alone = trainer.model(torch.tensor([short])).logits[0, 0]
    assert batch[0].item() == pytest.approx(alone.item(), abs=1e-5)
    trainer.train()
