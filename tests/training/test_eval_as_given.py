"""GKD, SDFT and SDPO keep `eval_dataset` as given (TRL's trainers do): a set, a stream or a dict of sets is
prepared when evaluation first reads it, once per dataset object, and evaluates as a prepared set would; GOLD (an
SFT trainer in TRL) still prepares its eval sets up front."""

from __future__ import annotations

import math

from datasets import Dataset
from test_gkd import _kw, _messages, _teacher

from posttrain.experimental.gkd import GKDConfig, GKDTrainer
from posttrain.experimental.gold import GOLDConfig, GOLDTrainer
from posttrain.experimental.sdft import SDFTConfig, SDFTTrainer
from posttrain.models.tiny import build_tiny_model


def _gkd(tmp_path, tokenizer, eval_dataset):
    return GKDTrainer(
        build_tiny_model(tokenizer),
        _teacher(tokenizer),
        args=GKDConfig(**_kw(tmp_path, lmbda=0.0, per_device_eval_batch_size=4)),
        train_dataset=_messages(4, tokenizer),
        eval_dataset=eval_dataset,
        processing_class=tokenizer,
    )


def test_gkd_evaluates_the_set_it_kept(tmp_path, tokenizer):
    given = _messages(4, tokenizer, seed=1)
    trainer = _gkd(tmp_path, tokenizer, given)
    assert trainer.eval_dataset is given
    first, second = trainer.evaluate(), trainer.evaluate()
    assert math.isfinite(first["eval_loss"]) and first["eval_loss"] == second["eval_loss"]
    # the same rows prepared up front evaluate to the same loss
    prepared = trainer.prepare_dataset(given, tokenizer, trainer.args, "eval_dataset")
    assert trainer.evaluate(prepared)["eval_loss"] == first["eval_loss"]
    assert trainer.evaluate(given.to_iterable_dataset())["eval_loss"] == first["eval_loss"]


def test_gkd_keeps_a_dict_of_sets(tmp_path, tokenizer):
    sets = {"a": _messages(4, tokenizer, seed=1), "b": _messages(4, tokenizer, seed=2)}
    trainer = _gkd(tmp_path, tokenizer, sets)
    assert trainer.eval_dataset is sets
    metrics = trainer.evaluate()
    assert math.isfinite(metrics["eval_a_loss"]) and math.isfinite(metrics["eval_b_loss"])
    assert metrics["eval_a_loss"] != metrics["eval_b_loss"]


def test_sdft_keeps_the_eval_set(tmp_path, tokenizer):
    data = Dataset.from_list(
        [{"prompt": [{"role": "user", "content": f"Name {w}."}], "privileged_context": f"It is {w}."} for w in "ab"]
    )
    trainer = SDFTTrainer(
        build_tiny_model(tokenizer),
        args=SDFTConfig(**_kw(tmp_path, num_generations=2, max_completion_length=4, per_device_eval_batch_size=4)),
        train_dataset=data,
        eval_dataset=data,
        processing_class=tokenizer,
    )
    assert trainer.eval_dataset is data
    metrics = trainer.evaluate()
    assert math.isfinite(metrics["eval_loss"]) and "eval_sdft/distillation_loss" in metrics


def test_gold_prepares_its_eval_set_up_front(tmp_path, tokenizer):
    given = _messages(4, tokenizer, seed=1)
    trainer = GOLDTrainer(
        build_tiny_model(tokenizer),
        _teacher(tokenizer),
        args=GOLDConfig(**_kw(tmp_path, lmbda=0.0)),
        train_dataset=_messages(4, tokenizer),
        eval_dataset=given,
        processing_class=tokenizer,
    )
    assert trainer.eval_dataset is not given and "input_ids" in trainer.eval_dataset.column_names
