"""TRL's self-distillation callback events (posttrain/trainers/self_distillation_events.py) on tiny SDFT and SDPO runs:
their order and count per round, TRL's tensor layout (the teacher's rows end in the completion block), the prompts
they carry, and the log-probs at sampling against the untrained model's own log-probs of the same tokens."""

import pytest
import torch
from datasets import Dataset
from transformers import AutoModelForCausalLM, TrainerCallback

from posttrain.experimental.sdft import SDFTConfig, SDFTTrainer
from posttrain.experimental.sdpo import SDPOConfig, SDPOTrainer
from posttrain.trainers.self_distillation_events import EVENTS


class Recorder(TrainerCallback):
    """Keeps every self-distillation event's name and keyword arguments."""

    def __init__(self):
        self.events = []
        for name in EVENTS:
            setattr(self, name, lambda name=name, **kw: self.events.append((name, kw)))

    def named(self, name):
        return [kw for event, kw in self.events if event == name]


def _settings(tmp_path, **kw):
    base = dict(
        output_dir=str(tmp_path),
        per_device_train_batch_size=1,
        num_generations=1,
        max_completion_length=6,
        max_steps=2,
        learning_rate=0.1,
        report_to="none",
        save_strategy="no",
        use_cpu=True,
        bf16=False,
        disable_tqdm=True,
        seed=0,
    )
    return {**base, **kw}


DATA = Dataset.from_dict({"prompt": ["Solve 2+2.", "Solve 3+3."], "privileged_context": ["It is 4.", "It is 6."]})


def test_sdft_events_once_per_round_in_trls_order_and_layout(tmp_path, tiny_model_path):
    recorder = Recorder()
    args = SDFTConfig(**_settings(tmp_path, steps_per_generation=2))  # one round feeds both steps
    trainer = SDFTTrainer(tiny_model_path, args=args, train_dataset=DATA, callbacks=[recorder])
    trainer.train()
    names = [name for name, _ in recorder.events]
    assert names == [
        "on_generation_prompts_selected",
        "on_self_distillation_batch_prepared",
        "on_generation_batch_built",
    ]
    assert recorder.named("on_generation_batch_built")[0]["generate_every"] == 2
    (selected,), (prepared,) = (
        recorder.named("on_generation_prompts_selected"),
        recorder.named("on_self_distillation_batch_prepared"),
    )
    tokenizer = trainer.processing_class
    decoded = [tokenizer.decode(ids, skip_special_tokens=True) for ids in prepared["prompt_ids"]]
    assert sorted(selected["generation_prompts"]) == sorted(DATA["prompt"]) == sorted(d.strip() for d in decoded)
    assert "self_distillation_mask" not in prepared  # SDPO's argument
    completion = prepared["completion_ids"]
    width = completion.shape[1]
    mask = prepared["teacher_attention_mask"][:, -width:]
    assert torch.equal(prepared["teacher_input_ids"][:, -width:][mask.bool()], completion[mask.bool()])
    teachers = [tokenizer.decode(ids, skip_special_tokens=True) for ids in prepared["teacher_input_ids"]]
    assert all("It is" in text for text in teachers)
    # the rounds go stale (1 accumulation step, rounds of 2): the log-probs at sampling are the untrained model's
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path)
    old = prepared["old_per_token_logps"]
    for row in range(2):
        prompt = prepared["prompt_ids"][row][prepared["prompt_ids"][row] != tokenizer.pad_token_id]
        tokens = completion[row][mask[row].bool()]
        with torch.no_grad():
            logits = model(torch.cat([prompt, tokens])[None]).logits[0, len(prompt) - 1 : -1].double()
        expected = logits.log_softmax(-1).gather(-1, tokens[:, None])[:, 0]
        torch.testing.assert_close(old[row, : len(tokens)].double(), expected, rtol=1e-4, atol=1e-4)


def test_sdft_generate_from_teacher_selects_the_teachers_prompts_and_keeps_no_logps(tmp_path, tiny_model_path):
    recorder = Recorder()
    args = SDFTConfig(**_settings(tmp_path, steps_per_generation=2, generate_from_teacher=True))
    SDFTTrainer(tiny_model_path, args=args, train_dataset=DATA, callbacks=[recorder]).train()
    (selected,), (prepared,) = (
        recorder.named("on_generation_prompts_selected"),
        recorder.named("on_self_distillation_batch_prepared"),
    )
    assert all("It is" in prompt for prompt in selected["generation_prompts"])
    assert prepared["old_per_token_logps"] is None  # TRL keeps none when the teacher's prompt sampled


@pytest.mark.parametrize("accumulation", [1, 2])
def test_sdpo_events_carry_the_teacher_context_and_masks(tmp_path, tiny_model_path, accumulation):
    recorder = Recorder()
    args = SDPOConfig(
        **_settings(tmp_path, num_generations=2, gradient_accumulation_steps=accumulation, max_steps=1),
        generation_batch_size=2,
        success_reward_threshold=0.5,
    )
    trainer = SDPOTrainer(
        tiny_model_path,
        reward_funcs=lambda completions, **kw: [1.0, 0.0][: len(completions)],
        args=args,
        train_dataset=DATA.select([0]),
        callbacks=[recorder],
    )
    trainer.train()
    names = [name for name, _ in recorder.events]
    # generation_batch_size=2: rounds of steps_per_generation=2 micro-batches of one rollout; one round in one step
    assert names == [
        "on_generation_prompts_selected",
        "on_teacher_context_built",
        "on_self_distillation_batch_prepared",
        "on_generation_batch_built",
    ]
    context, prepared = (
        recorder.named("on_teacher_context_built")[0],
        recorder.named("on_self_distillation_batch_prepared")[0],
    )
    width = context["completion_mask"].shape[1]
    assert torch.equal(context["teacher_attention_mask"][:, -width:], context["completion_mask"])
    assert torch.equal(prepared["self_distillation_mask"], context["self_distillation_mask"])
    # the second rollout failed and the first succeeded: it alone is reprompted with the success (SDPO's rule)
    assert context["self_distillation_mask"].tolist() == [0.0, 1.0]
    # with one accumulation step the round outlives the step, so its rollouts keep their log-probs (TRL's rule)
    assert (prepared["old_per_token_logps"] is None) is (accumulation == 2)
