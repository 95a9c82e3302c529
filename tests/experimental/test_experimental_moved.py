"""`posttrain.experimental.kto` and `.distillation`: TRL's deprecated import paths of the promoted trainers. A TRL
user's import works, warns where the stable name lives, and trains exactly like the stable class."""

import inspect
import random
import warnings

import pytest
import torch
from datasets import Dataset

import posttrain
from posttrain.models.tiny import build_tiny_model

WORDS = "red green blue cat dog bird fish sky sun moon tree one two three".split()


def _common(tmp_path):
    return dict(
        output_dir=str(tmp_path),
        per_device_train_batch_size=4,
        max_steps=1,
        learning_rate=1e-2,
        save_strategy="no",
        report_to="none",
        use_cpu=True,
        bf16=False,
        seed=0,
        max_length=64,
        disable_tqdm=True,
    )


def _kto_data():
    return Dataset.from_list(
        [
            {"prompt": f"{WORDS[i]} is", "completion": (" good" if i % 2 else " bad") + " one", "label": bool(i % 2)}
            for i in range(8)
        ]
    )


def _distillation_data():
    rng = random.Random(0)
    return Dataset.from_list(
        [{"prompt": " ".join(rng.choices(WORDS, k=3)), "completion": " " + rng.choice(WORDS)} for _ in range(8)]
    )


def _train(module, config_name, trainer_name, tokenizer, tmp_path, **extra):
    config_cls, trainer_cls = getattr(module, config_name), getattr(module, trainer_name)
    if config_name == "KTOConfig":
        args = config_cls(**_common(tmp_path))
        trainer = trainer_cls(
            build_tiny_model(tokenizer), args=args, train_dataset=_kto_data(), processing_class=tokenizer
        )
    else:
        args = config_cls(**_common(tmp_path), lmbda=0.0)
        teacher = build_tiny_model(tokenizer, seed=1)
        trainer = trainer_cls(
            build_tiny_model(tokenizer),
            teacher,
            args=args,
            train_dataset=_distillation_data(),
            processing_class=tokenizer,
        )
    trainer.train()
    return trainer


@pytest.mark.parametrize(
    "module_name,config_name,trainer_name",
    [("kto", "KTOConfig", "KTOTrainer"), ("distillation", "DistillationConfig", "DistillationTrainer")],
)
def test_trl_import_path_warns_and_trains_like_the_stable_class(
    tmp_path, tokenizer, module_name, config_name, trainer_name
):
    import importlib

    moved = importlib.import_module(f"posttrain.experimental.{module_name}")  # trl -> posttrain, nothing else
    assert issubclass(getattr(moved, trainer_name), getattr(posttrain, trainer_name))
    assert issubclass(getattr(moved, config_name), getattr(posttrain, config_name))
    with pytest.warns(FutureWarning) as caught:
        trainer = _train(moved, config_name, trainer_name, tokenizer, tmp_path / "moved")
    messages = [str(w.message) for w in caught if issubclass(w.category, FutureWarning)]
    for name in (config_name, trainer_name):
        assert any(
            f"from posttrain import {name}`" in m and f"posttrain.experimental.{module_name}.{name}" in m
            for m in messages
        ), messages
    # The warning points at the user's line, not at posttrain's internals.
    assert all(w.filename == __file__ for w in caught if "posttrain.experimental" in str(w.message))
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)  # the stable path does not warn
        stable = _train(posttrain, config_name, trainer_name, tokenizer, tmp_path / "stable")
    assert trainer.state.global_step == stable.state.global_step == 1
    moved_params, stable_params = dict(trainer.model.named_parameters()), dict(stable.model.named_parameters())
    initial = dict(build_tiny_model(tokenizer).named_parameters())
    changed = 0
    for name, value in stable_params.items():
        assert torch.equal(moved_params[name], value), name
        changed += not torch.equal(value, initial[name])
    assert changed > 0  # the step did train


@pytest.mark.parametrize("module_name,trainer_name", [("kto", "KTOTrainer"), ("distillation", "DistillationTrainer")])
def test_signature_is_the_stable_one(module_name, trainer_name):
    import importlib

    moved = getattr(importlib.import_module(f"posttrain.experimental.{module_name}"), trainer_name)
    assert inspect.signature(moved.__init__) == inspect.signature(getattr(posttrain, trainer_name).__init__)
