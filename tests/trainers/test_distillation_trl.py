"""DistillationTrainer against TRL 1.16's: the same loss on the same tiny student, teacher and on-policy batch,
TRL's defaults and signature, and what each TRL option changes."""

import inspect
import os
import random

import pytest
import torch
from _trl import import_trl
from datasets import Dataset

from posttrain import DistillationConfig, DistillationTrainer
from posttrain.errors import ConfigError
from posttrain.models.tiny import build_tiny_model

WORDS = "red green blue cat dog bird fish sky sun moon tree one two three".split()


def _prompts(n, seed=0):
    rng = random.Random(seed)
    return Dataset.from_list([{"prompt": " ".join(rng.choices(WORDS, k=2 + i % 3))} for i in range(n)])


def _teacher(tokenizer):
    teacher = build_tiny_model(tokenizer, seed=1, hidden_size=64, tie=False)
    with torch.no_grad():
        teacher.lm_head.weight.mul_(5.0)
    return teacher


def _kw(tmp_path, **kw):
    base = dict(
        output_dir=str(tmp_path),
        per_device_train_batch_size=4,
        max_steps=2,
        report_to="none",
        save_strategy="no",
        use_cpu=True,
        bf16=False,
        disable_tqdm=True,
        seed=0,
    )
    return {**base, **kw}


def _ours(tmp_path, tokenizer, data=None, teacher=None, **kw):
    return DistillationTrainer(
        build_tiny_model(tokenizer),
        teacher if teacher is not None else _teacher(tokenizer),
        args=DistillationConfig(**_kw(tmp_path, **kw)),
        train_dataset=data or _prompts(8),
        processing_class=tokenizer,
    )


@pytest.mark.parametrize("beta,temperature", [(1.0, 1.0), (0.5, 2.0), (0.0, 0.7)])
def test_step0_loss_and_entropy_equal_trls_on_the_same_completions(tmp_path, tokenizer, beta, temperature):
    trl = import_trl("distillation_config", "distillation_trainer")
    student, teacher = build_tiny_model(tokenizer), _teacher(tokenizer)
    theirs = trl.DistillationTrainer(
        model=student,
        teacher_model=teacher,
        processing_class=tokenizer,
        train_dataset=_prompts(4),
        args=trl.DistillationConfig(
            **_kw(
                tmp_path / "trl",
                bf16=False,
                gradient_checkpointing=False,
                beta=beta,
                temperature=temperature,
                max_completion_length=6,
            )
        ),
    )
    theirs.model.eval()
    batch = theirs._generate_and_score_completions([theirs.train_dataset[i] for i in range(4)])
    with torch.no_grad():
        trl_loss = theirs.compute_loss(theirs.model, batch).item()
    trl_entropy = theirs._metrics["eval"]["entropy"][-1]

    ours = DistillationTrainer(
        build_tiny_model(tokenizer),
        _teacher(tokenizer),
        processing_class=tokenizer,
        train_dataset=_prompts(4),
        args=DistillationConfig(**_kw(tmp_path / "ours", beta=beta, temperature=temperature, max_completion_length=6)),
    )
    rows = []
    for i in range(4):
        prompt = batch["prompt_ids"][i][batch["prompt_mask"][i].bool()].tolist()
        completion = batch["completion_ids"][i][batch["completion_mask"][i].bool()].tolist()
        assert prompt == ours.train_dataset[i]["input_ids"]  # the same prompt tokens
        rows.append({"input_ids": prompt + completion, "completion_mask": [0] * len(prompt) + [1] * len(completion)})
    ours.model.eval()
    with torch.no_grad():
        our_loss = ours.compute_loss(ours.model, ours.data_collator(rows)).item()
    assert our_loss > 0
    assert our_loss == pytest.approx(trl_loss, abs=1e-5, rel=1e-5)
    assert ours._metrics["eval"]["entropy"][-1] == pytest.approx(trl_entropy, abs=1e-5, rel=1e-5)


def test_signature_and_defaults_are_trls():
    trl = import_trl("distillation_config", "distillation_trainer")
    params = list(inspect.signature(DistillationTrainer.__init__).parameters)[1:]
    theirs = list(inspect.signature(trl.DistillationTrainer.__init__).parameters)[1:]
    assert params[: len(theirs)] == theirs
    args = DistillationConfig(output_dir="unused", use_cpu=True)
    assert (args.beta, args.lmbda, args.alpha, args.learning_rate, args.max_completion_length) == (
        1.0,
        1.0,
        1.0,
        1e-6,
        512,
    )
    assert args.pad_to_multiple_of is None and args.shuffle_dataset and args.remove_unused_columns is False


def test_default_is_on_policy_and_reads_only_prompts(tmp_path, tokenizer):
    data = Dataset.from_list([{"prompt": "red cat", "completion": " blue sky"}] * 4)
    trainer = _ours(tmp_path, tokenizer, data=data, max_completion_length=3, logging_steps=1)
    assert set(trainer.train_dataset[0]["completion_mask"]) == {0}  # the completion column is not read
    assert trainer.train_dataset[0]["input_ids"] == tokenizer("red cat")["input_ids"]
    trainer.train()
    logs = [h for h in trainer.state.log_history if "loss" in h]
    assert len(logs) == 2
    for log in logs:
        assert log["on_policy"] == 1.0 and log["completions/max_length"] <= 3 and log["entropy"] > 0
        assert 0 <= log["completions/clipped_ratio"] <= 1 and log["distill_loss"] == pytest.approx(log["loss"], 1e-3)


def test_sampling_settings_reach_the_sampler(tmp_path, tokenizer):
    args = DistillationConfig(
        **_kw(
            tmp_path,
            temperature=0.7,
            top_p=0.9,
            top_k=5,
            min_p=0.05,
            repetition_penalty=1.3,
            max_completion_length=9,
            generation_kwargs='{"top_k": 7, "max_new_tokens": 4, "no_repeat_ngram_size": 2}',
        )
    )
    params = args.sampling_params()
    assert (
        params.temperature,
        params.top_p,
        params.top_k,
        params.min_p,
        params.repetition_penalty,
        params.max_tokens,
        params.extra,
    ) == (0.7, 0.9, 7, 0.05, 1.3, 4, {"no_repeat_ngram_size": 2})
    trainer = _ours(
        tmp_path, tokenizer, generation_kwargs={"max_new_tokens": 2}, lmbda=1.0, cache_implementation="static"
    )
    assert trainer._sampler.cache_implementation == "static"
    batch = trainer.data_collator([trainer.train_dataset[i] for i in range(4)])
    sampled = trainer._student_batch(batch, 0, "train")
    prompt_lengths = batch["attention_mask"].sum(1)
    assert ((sampled["attention_mask"].sum(1) - prompt_lengths) <= 2).all()
    assert (sampled["attention_mask"].sum(1) - prompt_lengths).max() >= 1


def test_pad_to_multiple_of_and_shuffle_dataset(tmp_path, tokenizer):
    trainer = _ours(tmp_path, tokenizer, pad_to_multiple_of=16, shuffle_dataset=False)
    batch = trainer.data_collator([trainer.train_dataset[i] for i in range(3)])
    assert batch["input_ids"].shape[1] == 16
    assert isinstance(trainer._get_train_sampler(), torch.utils.data.SequentialSampler)
    shuffled = _ours(tmp_path, tokenizer)
    assert not isinstance(shuffled._get_train_sampler(), torch.utils.data.SequentialSampler)
    assert DistillationConfig(**_kw(tmp_path, pad_to_multiple_of="None")).pad_to_multiple_of is None


def test_log_completions_writes_trls_file(tmp_path, tokenizer):
    pd = pytest.importorskip("pandas")
    trainer = _ours(tmp_path, tokenizer, log_completions=True, logging_steps=1, max_steps=1, max_completion_length=3)
    trainer.train()
    table = pd.read_parquet(os.path.join(tmp_path, "completions", "completions_00001.parquet"))
    assert list(table.columns) == ["step", "prompt", "completion"] and len(table) == 4
    assert set(table["prompt"]) <= set(_prompts(8)["prompt"])


def test_teacher_revision_is_used_when_loading_by_name(tmp_path, tokenizer, tiny_model_path, monkeypatch):
    import posttrain.trainers.distillation as distillation

    seen = []
    original = distillation.load_causal_lm
    monkeypatch.setattr(distillation, "load_causal_lm", lambda m, kw=None: seen.append(kw) or original(m))
    DistillationTrainer(
        build_tiny_model(tokenizer),
        tiny_model_path,
        processing_class=tokenizer,
        train_dataset=_prompts(4),
        args=DistillationConfig(
            **_kw(tmp_path, teacher_model_revision="v2", teacher_model_init_kwargs={"dtype": "float32"})
        ),
    )
    assert seen == [{"trust_remote_code": False, "dtype": "float32", "revision": "v2"}]


@pytest.mark.parametrize(
    "setting,message",
    [
        ({"use_vllm": True}, "use_vllm=True is not supported"),
        ({"ds3_gather_for_generation": False}, "DeepSpeed ZeRO-3"),
        ({"generation_kwargs": {"num_beams": 2}}, r"generation_kwargs\['num_beams'\] cannot be changed"),
        ({"generation_kwargs": {"not_a_setting": 2}}, r"GenerationConfig does not know: \['not_a_setting'\]"),
        ({"lmbda": 0.5, "padding_free": True}, "set padding_free=False"),
        ({"top_p": 0.0}, "top_p=0.0 is invalid"),
        ({"max_tool_calling_iterations": 3}, "tool calling runs on the online engine"),
    ],
)
def test_bad_settings_fail_when_the_config_is_built(tmp_path, setting, message):
    with pytest.raises(ConfigError, match=message):
        DistillationConfig(**_kw(tmp_path, **setting))


def test_errors_name_the_option(tmp_path, tokenizer):
    def tool(x: int) -> int:
        """Doubles x."""
        return 2 * x

    with pytest.raises(ConfigError, match="tool-calling rollouts run on GRPOTrainer, RLOOTrainer and PPOTrainer"):
        DistillationTrainer(
            build_tiny_model(tokenizer),
            _teacher(tokenizer),
            args=DistillationConfig(**_kw(tmp_path)),
            train_dataset=_prompts(4),
            processing_class=tokenizer,
            tools=[tool],
        )
    with pytest.raises(ConfigError, match="teacher_model_revision only applies"):
        _ours(tmp_path, tokenizer, teacher_model_revision="main")
    with pytest.raises(ConfigError, match="has only prompts. Set lmbda=1.0"):
        _ours(tmp_path, tokenizer, lmbda=0.5)
