"""remove_unused_columns as in TRL 1.16: True by default on SFT, DPO, KTO, Reward, GOLD and the asynchronous trainers
(TRL's default); with True the columns each trainer's collator reads are kept and training is the same as with False;
True drops a column no collator reads (an extra `metadata`), False passes it to the collator. The asynchronous
trainers' reward functions get every dataset column either way, as TRL's rollout worker passes them."""

from __future__ import annotations

import dataclasses
import importlib

import pytest
from _trl import import_trl, import_trl_experimental
from datasets import Dataset

import posttrain
from posttrain import DPOConfig, DPOTrainer, KTOConfig, KTOTrainer, RewardConfig, RewardTrainer, SFTConfig, SFTTrainer

CONFIGS = ["SFTConfig", "DPOConfig", "KTOConfig", "RewardConfig", "GRPOConfig", "RLOOConfig", "DistillationConfig"]
MODULES = [name.replace("Config", "").lower() + "_config" for name in CONFIGS]  # trl.trainer modules
# TRL's experimental configs, by module (DistillationConfig's subclasses inherit its False where TRL's do)
EXPERIMENTAL = [
    ("tpo", "TPOConfig"),
    ("gkd", "GKDConfig"),
    ("iw_opd", "IWOPDConfig"),
    ("sdft", "SDFTConfig"),
    ("sdpo", "SDPOConfig"),
    ("server_distillation", "ServerDistillationConfig"),
    ("gold", "GOLDConfig"),
    ("async_grpo", "AsyncGRPOConfig"),
    ("async_distillation", "AsyncDistillationConfig"),
]


def _default(cls):
    return next(f.default for f in dataclasses.fields(cls) if f.name == "remove_unused_columns")


@pytest.mark.parametrize("name", CONFIGS)
def test_default_is_trls(name):
    trl = import_trl(*MODULES)
    assert _default(getattr(posttrain, name)) is _default(getattr(trl, name))


@pytest.mark.parametrize("module, name", EXPERIMENTAL)
def test_experimental_default_is_trls(module, name):
    theirs = getattr(import_trl_experimental(module), name)
    ours = getattr(importlib.import_module(f"posttrain.experimental.{module}"), name)
    assert _default(ours) is _default(theirs)


def _settings(tmp_path, **kw):
    return dict(
        output_dir=str(tmp_path / "out"),
        per_device_train_batch_size=2,
        max_steps=2,
        learning_rate=1e-2,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        use_cpu=True,
        seed=0,
        max_length=48,
        disable_tqdm=True,
        **kw,
    )


def _sft(tmp_path, path, data, **kw):
    return SFTTrainer(path, args=SFTConfig(**_settings(tmp_path, **kw)), train_dataset=data)


def _dpo(tmp_path, path, data, **kw):
    args = DPOConfig(**_settings(tmp_path, ref_cache_dir=str(tmp_path / "ref"), **kw))
    return DPOTrainer(path, args=args, train_dataset=data)


def _kto(tmp_path, path, data, **kw):
    return KTOTrainer(path, args=KTOConfig(**_settings(tmp_path, **kw)), train_dataset=data)


def _reward(tmp_path, path, data, **kw):
    return RewardTrainer(path, args=RewardConfig(**_settings(tmp_path, **kw)), train_dataset=data)


def _rows(kind: str, n: int = 4) -> Dataset:
    """n rows of the trainer's data format, each with an extra string column no collator reads."""
    words = ["red", "green", "blue", "cat", "dog", "sun"]
    rows = []
    for i in range(n):
        w, v = words[i % 6], words[(i + 2) % 6]
        if kind == "sft":
            row = {"prompt": f"say {w}", "completion": f" {w} {v}"}
        elif kind == "kto":
            row = {"prompt": f"the {w} is", "completion": " good" if i % 2 == 0 else " bad bad", "label": i % 2 == 0}
        else:
            row = {"prompt": f"the {w} is", "chosen": f" good {v}", "rejected": " bad" * (1 + i % 2)}
        rows.append({**row, "metadata": f"source-{i}"})
    return Dataset.from_list(rows)


class _Recorder:
    """Wraps a collator and keeps the keys of every example it is given."""

    def __init__(self, inner):
        self.inner, self.keys = inner, set()

    def __call__(self, examples):
        for example in examples:
            self.keys |= set(example)
        return self.inner(examples)


def _train(build, tmp_path, path, data, **kw):
    trainer = build(tmp_path, path, data, **kw)
    recorder = _Recorder(trainer.data_collator)
    trainer.data_collator = recorder
    trainer.train()
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    return losses, recorder.keys


def _bco(tmp_path, path, data, **kw):
    from posttrain.experimental.bco import BCOConfig, BCOTrainer

    return BCOTrainer(path, args=BCOConfig(**_settings(tmp_path, **kw)), train_dataset=data)


def test_bco_default_is_transformers_true():
    """TRL 1.16 has no BCO; its last BCOConfig kept TrainingArguments' True (its bco.py passes
    --no_remove_unused_columns)."""
    from posttrain.experimental.bco import BCOConfig

    assert _default(BCOConfig) is True


TRAINERS = [(_sft, "sft"), (_dpo, "dpo"), (_kto, "kto"), (_reward, "reward"), (_bco, "kto")]


@pytest.mark.parametrize("build, kind", TRAINERS, ids=[build.__name__[1:] for build, _ in TRAINERS])
def test_extra_column_trains_as_with_false(build, kind, tmp_path, tiny_model_path):
    data = _rows(kind)
    default, seen = _train(build, tmp_path / "default", tiny_model_path, data)
    kept, _ = _train(build, tmp_path / "kept", tiny_model_path, data, remove_unused_columns=False)
    assert len(default) == 2 and all(loss > 0 for loss in default)
    assert default == pytest.approx(kept, rel=1e-6)
    assert "metadata" not in seen


def test_sft_true_drops_and_false_passes_a_column_the_collator_does_not_read(tmp_path, tiny_model_path, tokenizer):
    """A trainer-ready dataset (skip_prepare_dataset) reaches the collator as it is: TRL's meaning of the field."""
    rows = [{"input_ids": tokenizer(f" say {w} now")["input_ids"], "metadata": w} for w in ["red", "cat", "sun", "dog"]]
    data = Dataset.from_list(rows)
    options = dict(dataset_kwargs={"skip_prepare_dataset": True})
    dropped, without = _train(_sft, tmp_path / "true", tiny_model_path, data, **options)
    passed, with_it = _train(_sft, tmp_path / "false", tiny_model_path, data, remove_unused_columns=False, **options)
    assert without == {"input_ids"} and with_it == {"input_ids", "metadata"}
    assert dropped == pytest.approx(passed, rel=1e-6)


def test_reward_keeps_tokenized_pairs_and_margin(tmp_path, tiny_model_path):
    rows = [
        {"prompt_ids": [5, 6], "chosen_ids": [7, 8], "rejected_ids": [9], "margin": 0.5, "metadata": "x"},
        {"prompt_ids": [5], "chosen_ids": [10], "rejected_ids": [11, 12], "margin": 1.0, "metadata": "y"},
    ]
    _, seen = _train(_reward, tmp_path, tiny_model_path, Dataset.from_list(rows * 2))
    assert seen == {"prompt_ids", "chosen_ids", "rejected_ids", "margin"}


def _gold(tmp_path, path, data, **kw):
    from transformers import AutoTokenizer

    from posttrain.experimental.gold import GOLDConfig, GOLDTrainer
    from posttrain.models.tiny import build_tiny_model

    teacher = build_tiny_model(AutoTokenizer.from_pretrained(path), seed=1)  # another model: a nonzero divergence
    args = GOLDConfig(**_settings(tmp_path, lmbda=0.5, max_completion_length=6, **kw))
    return GOLDTrainer(path, teacher, args=args, train_dataset=data)


def test_gold_extra_column_trains_as_with_false(tmp_path, tiny_model_path):
    """GOLD (an SFT trainer in TRL) keeps SFT's columns; its on-policy micro-batches sample the same either way."""
    data = _rows("sft")
    default, seen = _train(_gold, tmp_path / "default", tiny_model_path, data)
    kept, _ = _train(_gold, tmp_path / "kept", tiny_model_path, data, remove_unused_columns=False)
    assert len(default) == 2 and all(loss > 0 for loss in default)
    assert default == pytest.approx(kept, rel=1e-6)
    assert "metadata" not in seen


def _online_run(kind, tmp_path, path, **kw):
    """A two-step asynchronous run on prompts with an extra 'answer' column: its losses, and the keyword arguments
    its reward function was given (AsyncGRPO) or the columns it reads for its reward (AsyncDistillation)."""
    import test_async_distillation as distillation
    import test_async_grpo as grpo
    from test_engine import prompt_dataset

    from posttrain.experimental.async_distillation import AsyncDistillationTrainer
    from posttrain.experimental.async_grpo import AsyncGRPOTrainer

    seen = set()

    def low_ids(completion_ids, **columns):
        seen.update(columns)
        return [sum(t < 192 for t in ids) / len(ids) for ids in completion_ids]

    if kind == "async_grpo":
        args = grpo._config(tmp_path, logging_steps=1, **kw)
        trainer = AsyncGRPOTrainer(path, low_ids, args=args, train_dataset=prompt_dataset())
    else:
        args = distillation._config(tmp_path, logging_steps=1, **kw)
        teacher = distillation.biased_teacher(path)
        trainer = AsyncDistillationTrainer(path, args=args, train_dataset=prompt_dataset(), teacher_model=teacher)
        seen.update(trainer.reward_columns)
    trainer.train()
    return [h["loss"] for h in trainer.state.log_history if "loss" in h], seen


@pytest.mark.parametrize("kind", ["async_grpo", "async_distillation"])
def test_async_extra_column_trains_as_with_false(kind, tmp_path, tiny_model_path):
    """posttrain's engine reads the dataset rows itself: the loss is the same either way, and the extra column
    reaches the reward function in both (TRL's rollout worker passes every column too)."""
    default, seen = _online_run(kind, tmp_path / "default", tiny_model_path)
    kept, seen_kept = _online_run(kind, tmp_path / "kept", tiny_model_path, remove_unused_columns=False)
    assert len(default) == 2 and all(loss != 0 for loss in default)
    assert default == pytest.approx(kept, rel=1e-6)
    if kind == "async_grpo":
        assert "answer" in seen and seen == seen_kept
