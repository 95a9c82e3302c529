"""Which weights GRPO and RLOO train on a vision-language model, as SFT and DPO: the vision tower is frozen by
default (`freeze_vision_tower`), the projector and the language model get gradients; with LoRA the tower gets no
adapter, the projector is trained in full and the caller's PEFT config is not modified. A weight "trains" when one
Adam step moves it (Adam leaves a weight whose gradient is zero where it is)."""

import pytest
import torch
from _vlm import common_args, image, vlm_paths  # noqa: F401
from datasets import Dataset

from posttrain import GRPOConfig, GRPOTrainer, RLOOConfig, RLOOTrainer

TRAINERS = {"grpo": (GRPOTrainer, GRPOConfig), "rloo": (RLOOTrainer, RLOOConfig)}


def prompts(n: int = 2) -> Dataset:
    return Dataset.from_list(
        [{"images": [image(i)], "prompt": [{"role": "user", "content": "what is" + " it" * i}]} for i in range(n)]
    )


def length_reward(completions, **kwargs):
    """Differs within every group of the tiny random model (its completions are random text of various lengths),
    so every completion has a non-zero advantage."""
    return [float(len(c[0]["content"])) for c in completions]


def trainer_for(method, path, tmp_path, peft_config=None, **kw):
    trainer_class, config_class = TRAINERS[method]
    args = config_class(
        **common_args(
            tmp_path,
            max_steps=1,
            per_device_train_batch_size=4,
            num_generations=4,
            max_completion_length=4,
            beta=0.0,
            **kw,
        )
    )
    return trainer_class(path, reward_funcs=length_reward, args=args, train_dataset=prompts(), peft_config=peft_config)


def snapshot(model) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def moved(before: dict, model, part: str) -> list[bool]:
    """For each parameter whose name contains `part`: whether the step changed it."""
    now = dict(model.named_parameters())
    return [not torch.equal(value, now[name].detach()) for name, value in before.items() if part in name]


def reward_had_variance(trainer) -> bool:
    return trainer.state.log_history[0]["reward_std"] > 0


@pytest.mark.parametrize("method", ["grpo", "rloo"])
def test_tower_frozen_projector_and_language_model_train_by_default(tmp_path, vlm_paths, method):
    trainer = trainer_for(method, vlm_paths["llava"], tmp_path)
    tower = [p for n, p in trainer.model.named_parameters() if ".vision_tower." in f".{n}"]
    assert tower and not any(p.requires_grad for p in tower)
    before = snapshot(trainer.model)
    trainer.train()
    assert reward_had_variance(trainer)
    assert not any(moved(before, trainer.model, "vision_tower"))
    assert all(moved(before, trainer.model, "multi_modal_projector"))
    assert any(moved(before, trainer.model, "language_model"))


def test_tower_trains_when_asked(tmp_path, vlm_paths):
    trainer = trainer_for("grpo", vlm_paths["llava"], tmp_path, freeze_vision_tower=False)
    assert all(p.requires_grad for p in trainer.model.parameters())
    before = snapshot(trainer.model)
    trainer.train()
    assert any(moved(before, trainer.model, "vision_tower.encoder"))


@pytest.mark.parametrize("given", ["path", "model"])
def test_lora_on_the_language_model_with_the_projector_trained_in_full(tmp_path, vlm_paths, given):
    from peft import LoraConfig
    from transformers import AutoModelForImageTextToText

    peft_config = LoraConfig(r=4, lora_alpha=8, target_modules="all-linear")
    model = vlm_paths["llava"] if given == "path" else AutoModelForImageTextToText.from_pretrained(vlm_paths["llava"])
    trainer = trainer_for("grpo", model, tmp_path, peft_config=peft_config)
    assert peft_config.modules_to_save is None and peft_config.exclude_modules is None  # the caller's is unchanged
    names = [n for n, _ in trainer.model.named_modules()]
    assert any("language_model" in n and "lora_A" in n for n in names)
    assert not any("vision_tower" in n and "lora" in n for n in names)
    trainable = {n for n, p in trainer.model.named_parameters() if p.requires_grad}
    assert not any("vision_tower" in n for n in trainable)
    assert (
        {n for n in trainable if "multi_modal_projector" in n}
        == {n for n in trainable if "multi_modal_projector" in n and "modules_to_save" in n}
        != set()
    )
    assert all("lora_" in n or "modules_to_save" in n for n in trainable)
    before = snapshot(trainer.model)
    trainer.train()
    assert reward_had_variance(trainer)
    assert not any(moved(before, trainer.model, "vision_tower"))
    assert all(moved(before, trainer.model, "multi_modal_projector.modules_to_save"))
    assert any(moved(before, trainer.model, "lora_B"))  # lora_B starts at 0: it moves first
    assert not any(moved(before, trainer.model, "base_layer"))
