"""Mixture-of-Experts models (Qwen3-MoE, Mixtral) train with SFT, DPO and GRPO: two optimizer steps each, with the
router's load-balancing loss logged and joined, and every expert, router and attention weight moved. The experts
compute as transformers groups them (`grouped_mm`, its default), which the fast forward runs as it is."""

import pytest
import torch
from datasets import Dataset

from posttrain import DPOConfig, DPOTrainer, GRPOConfig, GRPOTrainer, SFTConfig, SFTTrainer
from posttrain.models.tiny import MOE_FAMILIES, save_tiny_model

WORDS = "the cat sat on a mat and then it ran far away from the big red dog".split()
COMMON = dict(
    max_steps=2,
    logging_steps=1,
    learning_rate=1e-2,
    seed=0,
    use_cpu=True,
    report_to="none",
    save_strategy="no",
    disable_tqdm=True,
    per_device_train_batch_size=4,
)


def _text(i: int) -> str:
    return " ".join(WORDS[i % 5 : i % 5 + 4 + i % 7])


def _sft(path, output_dir):
    data = Dataset.from_list([{"text": _text(i)} for i in range(8)])
    args = SFTConfig(output_dir=output_dir, packing=True, max_length=32, **COMMON)
    return SFTTrainer(path, args=args, train_dataset=data)


def _dpo(path, output_dir):
    data = Dataset.from_list([{"prompt": _text(i), "chosen": " red", "rejected": " " + _text(i + 3)} for i in range(8)])
    return DPOTrainer(path, args=DPOConfig(output_dir=output_dir, max_length=32, **COMMON), train_dataset=data)


def _grpo(path, output_dir):
    data = Dataset.from_list([{"prompt": _text(i)} for i in range(8)])
    args = GRPOConfig(output_dir=output_dir, num_generations=4, max_completion_length=6, **COMMON)
    return GRPOTrainer(
        path, lambda completion_ids, **kwargs: [len(c) / 6.0 for c in completion_ids], args=args, train_dataset=data
    )


@pytest.mark.parametrize("method", [_sft, _dpo, _grpo], ids=["sft", "dpo", "grpo"])
@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_moe_models_train(tmp_path, family, method):
    path = save_tiny_model(tmp_path / family, family=family, router_aux_loss_coef=0.01)
    trainer = method(path, str(tmp_path / "out"))
    assert trainer.model.config._experts_implementation == "grouped_mm"
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    trainer.train()
    logs = [h for h in trainer.state.log_history if "loss" in h]
    assert len(logs) == 2 and all(torch.isfinite(torch.tensor(h["loss"])) for h in logs)
    assert all(h["aux_loss"] > 0 for h in logs)
    moved = {n for n, p in trainer.model.named_parameters() if not torch.equal(p.detach(), before[n])}
    for part in ("experts", "gate.weight", "self_attn.q_proj"):
        assert any(part in n for n in moved), part
