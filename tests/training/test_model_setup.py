"""The trainer seeds before it makes the model, as TRL 1.16 does: a PEFT adapter's random init (and a new head's)
follows `seed`, whatever the global generator held before, and equals TRL's for the same seed."""

from __future__ import annotations

import torch
from _trl import import_trl
from datasets import Dataset
from peft import LoraConfig
from transformers import AutoModelForCausalLM

from posttrain import SFTConfig, SFTTrainer


def _config(config_cls, tmp_path, seed):
    return config_cls(
        output_dir=str(tmp_path / "out"),
        per_device_train_batch_size=2,
        max_steps=1,
        save_strategy="no",
        report_to="none",
        use_cpu=True,
        bf16=False,
        seed=seed,
        max_length=32,
        disable_tqdm=True,
    )


def _adapter(trainer_cls, config_cls, path, tmp_path, seed, global_seed) -> dict[str, torch.Tensor]:
    torch.manual_seed(global_seed)  # what the caller's generator held before: must not matter
    trainer = trainer_cls(
        model=AutoModelForCausalLM.from_pretrained(path),
        args=_config(config_cls, tmp_path, seed),
        train_dataset=Dataset.from_list([{"text": "the cat sat on the mat"}] * 4),
        peft_config=LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False),
    )
    return {n: p.detach().clone() for n, p in trainer.model.named_parameters() if "lora_" in n}


def test_the_adapter_init_follows_seed_not_the_global_generator(tiny_model_path, tmp_path):
    first = _adapter(SFTTrainer, SFTConfig, tiny_model_path, tmp_path, seed=3, global_seed=1)
    again = _adapter(SFTTrainer, SFTConfig, tiny_model_path, tmp_path, seed=3, global_seed=2)
    other = _adapter(SFTTrainer, SFTConfig, tiny_model_path, tmp_path, seed=4, global_seed=1)
    assert first and first.keys() == again.keys() == other.keys()
    for name in first:
        assert torch.equal(first[name], again[name]), name
    assert not any(torch.equal(first[name], other[name]) for name in first)


def test_the_adapter_init_equals_trls_for_the_same_seed(tiny_model_path, tmp_path):
    trl = import_trl("sft_trainer")
    ours = _adapter(SFTTrainer, SFTConfig, tiny_model_path, tmp_path, seed=5, global_seed=1)
    theirs = _adapter(trl.SFTTrainer, trl.SFTConfig, tiny_model_path, tmp_path, seed=5, global_seed=2)
    assert ours.keys() == theirs.keys()
    for name in ours:
        torch.testing.assert_close(ours[name], theirs[name], rtol=0, atol=0, msg=name)
