"""Streaming (`datasets.IterableDataset`) train and eval data in every trainer, with max_steps: a stream is prepared
chunk by chunk as it is read (training/streaming.py), the online engine takes each round's prompts from the stream
in order (online/rollout.py), and what needs random access is refused before training."""

import pytest
from datasets import Dataset

from posttrain import (
    DPOConfig,
    DPOTrainer,
    GRPOConfig,
    GRPOTrainer,
    KTOConfig,
    KTOTrainer,
    RewardConfig,
    RewardTrainer,
    RLOOConfig,
    RLOOTrainer,
    SFTConfig,
    SFTTrainer,
)
from posttrain.errors import ConfigError
from posttrain.training import streaming

WORDS = ["red", "green", "blue", "cat", "dog", "sun", "moon", "tree"]


def _common(tmp_path, **kw):
    base = dict(
        output_dir=str(tmp_path / "out"),
        per_device_train_batch_size=2,
        per_device_eval_batch_size=2,
        max_steps=2,
        learning_rate=1e-3,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        use_cpu=True,
        bf16=False,
        disable_tqdm=True,
    )
    base.update(kw)
    return base


def _rows(kind: str, n: int = 12) -> Dataset:
    w = [WORDS[i % 8] for i in range(n)]
    if kind == "text":
        return Dataset.from_list([{"text": f"the {x} is {y}"} for x, y in zip(w, reversed(w))])
    if kind == "prompt":
        return Dataset.from_list([{"prompt": f"say {x}"} for x in w])
    if kind == "preference":
        return Dataset.from_list([{"prompt": f"say {x}", "chosen": f" {x}", "rejected": " no"} for x in w])
    if kind == "implicit":
        return Dataset.from_list([{"chosen": f"say {x} {x}", "rejected": f"say {x} no"} for x in w])
    return Dataset.from_list(  # unpaired
        [
            {"prompt": f"say {x}", "completion": f" {x}" if i % 2 else " no", "label": bool(i % 2)}
            for i, x in enumerate(w)
        ]
    )


def test_a_stream_is_prepared_chunk_by_chunk_like_the_same_rows_in_memory(tmp_path, tiny_model_path):
    data = _rows("text", 7)
    trainer = SFTTrainer(tiny_model_path, args=SFTConfig(**_common(tmp_path)), train_dataset=data)
    stream = streaming.prepare_streaming(
        lambda chunk: trainer.prepare_dataset(chunk, trainer.processing_class, trainer.args, "train_dataset"),
        data.to_iterable_dataset(),
        chunk_rows=3,
    )
    assert [row["input_ids"] for row in stream] == trainer.train_dataset["input_ids"]
    assert streaming.is_prepared(stream, "input_ids") and not streaming.is_prepared(data, "input_ids")


OFFLINE = [
    (SFTTrainer, SFTConfig, "text", {}),
    (DPOTrainer, DPOConfig, "preference", {}),
    (KTOTrainer, KTOConfig, "unpaired", {}),
    (RewardTrainer, RewardConfig, "implicit", {}),
]


@pytest.mark.parametrize("trainer_class, config_class, kind, extra", OFFLINE, ids=lambda v: getattr(v, "__name__", ""))
def test_offline_trainers_train_and_evaluate_on_streams(
    tmp_path, tiny_model_path, trainer_class, config_class, kind, extra
):
    data = _rows(kind)
    trainer = trainer_class(
        tiny_model_path,
        args=config_class(**_common(tmp_path, eval_strategy="steps", eval_steps=2, **extra)),
        train_dataset=data.to_iterable_dataset(),
        eval_dataset={"a": data.select(range(4)).to_iterable_dataset(), "b": data.select(range(2))},
    )
    trainer.train()
    assert trainer.state.global_step == 2
    logs = {k for entry in trainer.state.log_history for k in entry}
    assert {"loss", "eval_a_loss", "eval_b_loss"} <= logs
    assert trainer.evaluate(data.select(range(4)).to_iterable_dataset())["eval_loss"] > 0  # a raw stream too


def test_an_error_in_the_first_chunk_of_a_stream_stops_before_training(tmp_path, tiny_model_path):
    bad = Dataset.from_list([{"question": "no prompt column"}] * 4).to_iterable_dataset()
    with pytest.raises(ValueError, match="question"):
        DPOTrainer(tiny_model_path, args=DPOConfig(**_common(tmp_path)), train_dataset=bad)


def test_precomputed_reference_log_probs_refuse_a_stream(tmp_path, tiny_model_path):
    data = _rows("preference")
    args = DPOConfig(**_common(tmp_path, precompute_ref_log_probs=True))
    with pytest.raises(ConfigError, match="precompute_ref_log_probs=True is not supported with IterableDataset"):
        DPOTrainer(tiny_model_path, args=args, train_dataset=data.to_iterable_dataset())
    with pytest.raises(ConfigError, match=r"eval_dataset\['e'\] is a stream"):
        DPOTrainer(tiny_model_path, args=args, train_dataset=data, eval_dataset={"e": data.to_iterable_dataset()})


def _length_reward(completion_ids, **kwargs):
    return [float(len(ids)) for ids in completion_ids]


@pytest.mark.parametrize("trainer_class, config_class", [(GRPOTrainer, GRPOConfig), (RLOOTrainer, RLOOConfig)])
def test_online_trainers_take_each_rounds_prompts_from_the_stream(
    tmp_path, tiny_model_path, trainer_class, config_class
):
    data = _rows("prompt", 8)
    settings = _common(
        tmp_path,
        num_generations=2,
        max_completion_length=4,
        max_steps=3,
        per_device_eval_batch_size=2,
        shuffle_dataset=False,
    )
    trainer = trainer_class(
        tiny_model_path,
        _length_reward,
        args=config_class(**settings),
        train_dataset=data.to_iterable_dataset(),
        eval_dataset=data.select(range(2)).to_iterable_dataset(),
    )
    loader = trainer.get_train_dataloader()
    batches = [batch for _, batch in zip(range(4), loader)]
    # one prompt per round (generation batch 2 / 2 completions): rounds in the stream's order (not shuffled here),
    # one batch per step
    assert [(b["round"], b["rows"][0]["prompt"]) for b in batches] == [(i, f"say {WORDS[i]}") for i in range(4)]
    trainer.train()
    assert trainer.state.global_step == 3
    assert "eval_reward" in trainer.evaluate()


def test_online_settings_that_need_random_access_refuse_a_stream(tmp_path, tiny_model_path):
    stream = _rows("prompt", 8).to_iterable_dataset()
    settings = _common(tmp_path, num_generations=2, max_completion_length=4)
    with pytest.raises(ConfigError, match="dynamic_sampling=True does not work with a streaming train_dataset"):
        GRPOTrainer(
            tiny_model_path, _length_reward, args=GRPOConfig(**settings, dynamic_sampling=True), train_dataset=stream
        )
