"""GRPO and RLOO train vision-language models on image prompts: both train on the tiny architectures, the policy's
per-token log-probs of a rollout equal a float64 forward of each prompt + completion processed alone with its
image, the GRPO loss of a hand-built rollout equals a float64 reference, generation receives each prompt's pixels,
and bad inputs are refused before training."""

import pytest
import torch
from _vlm import common_args, image, vlm_paths  # noqa: F401
from datasets import Dataset
from transformers import AutoProcessor

from posttrain import GRPOConfig, GRPOTrainer, RLOOConfig, RLOOTrainer
from posttrain.data.transforms import prepare_multimodal_messages
from posttrain.data.vision import open_image
from posttrain.errors import ConfigError, DataError
from posttrain.online.rollout import Rollout

TRAINERS = {"grpo": (GRPOTrainer, GRPOConfig), "rloo": (RLOOTrainer, RLOOConfig)}


def prompt_data(n: int = 4, conversational: bool = True, offset: int = 0) -> Dataset:
    rows = []
    for i in range(n):
        prompt = (
            [{"role": "user", "content": "what is" + " it" * i}] if conversational else "<image> what is" + " it" * i
        )
        rows.append({"images": [image(i + offset)], "prompt": prompt, "answer": str(i)})
    return Dataset.from_list(rows)


def length_reward(completions, **kwargs):
    return [float(len(c if isinstance(c, str) else c[0]["content"])) for c in completions]


def online_args(tmp_path, config_class, **kw):
    base = dict(num_generations=2, max_completion_length=5, steps_per_generation=2, beta=0.1)
    base.update(kw)
    return config_class(**common_args(tmp_path, **base))


@pytest.mark.parametrize("arch", ["llava", "gemma3", "idefics3"])
@pytest.mark.parametrize("method", ["grpo", "rloo"])
def test_trains_two_steps_on_image_prompts(tmp_path, vlm_paths, arch, method):
    if arch == "idefics3" and method == "rloo":
        pytest.skip("two architectures per method keep the suite short")
    trainer_class, config_class = TRAINERS[method]
    trainer = trainer_class(
        vlm_paths[arch],
        reward_funcs=length_reward,
        args=online_args(tmp_path, config_class),
        train_dataset=prompt_data(4),
    )
    before = {
        n: p.detach().clone() for n, p in trainer.model.named_parameters() if "projector" in n or "connector" in n
    }
    assert before
    trainer.train()
    losses = [log["loss"] for log in trainer.state.log_history if "loss" in log]
    assert len(losses) == 2 and all(torch.isfinite(torch.tensor(losses)))
    assert trainer.rollout.vision is not None and len(trainer.rollout.vision) == len(trainer.rollout)
    now = dict(trainer.model.named_parameters())
    assert any(not torch.equal(p, now[n].detach()) for n, p in before.items())  # the projector got gradients


def _trainer(tmp_path, vlm_paths, arch, **kw):
    return GRPOTrainer(
        vlm_paths[arch],
        reward_funcs=length_reward,
        args=online_args(tmp_path, GRPOConfig, **kw),
        train_dataset=prompt_data(4),
    )


def _hand_built_rollout(trainer, rows, completions: list[list[int]]) -> Rollout:
    """Each row's prompt once per completion (n = len(completions) // len(rows)), processed by the trainer."""
    from posttrain.online.rollout import pad_rows

    n = len(completions) // len(rows)
    prompt_ids, parts = trainer.image_prompts.process(rows)
    prompts, mask = pad_rows([prompt_ids[i // n] for i in range(len(completions))], 0, left=True)
    ids, completion_mask = pad_rows(completions, 0, left=False)
    count = len(completions)
    return Rollout(
        0,
        prompts,
        mask,
        ids,
        completion_mask,
        completion_mask.clone(),
        completion_mask.clone(),
        torch.ones(count, dtype=torch.bool),
        torch.zeros(count),
        torch.zeros(count, 1),
        num_generations=n,
        vision=[parts[i // n] for i in range(count)],
    )


def _reference_logps(model, processor, row: dict, completion: list[int]) -> torch.Tensor:
    """float64 log-probs of `completion` after the row's prompt, from one unpadded forward of that row alone."""
    images = [open_image(i) for i in row["images"]]
    text = processor.apply_chat_template(
        prepare_multimodal_messages(row["prompt"], images), tokenize=False, add_generation_prompt=True
    )
    inputs = processor(text=[text], images=[images], add_special_tokens=False, return_tensors="pt")
    prompt_len = inputs["input_ids"].shape[1]
    inputs["input_ids"] = torch.cat([inputs["input_ids"], torch.tensor([completion])], 1)
    inputs["attention_mask"] = torch.ones_like(inputs["input_ids"])
    for key in ("token_type_ids", "mm_token_type_ids"):
        if key in inputs:
            inputs[key] = torch.cat([inputs[key], torch.zeros(1, len(completion), dtype=inputs[key].dtype)], 1)
    with torch.no_grad():
        logits = model(**inputs).logits[0].double()
    logps = torch.log_softmax(logits[prompt_len - 1 : -1], -1)
    return logps[torch.arange(len(completion)), torch.tensor(completion)]


COMPLETIONS = [[5, 9, 13, 2], [7, 3], [11, 4, 6], [8, 8, 8, 8]]


@pytest.mark.parametrize("arch", ["llava", "gemma3", "idefics3"])
def test_rollout_logps_equal_float64_forward_of_each_row_alone(tmp_path, vlm_paths, arch):
    trainer = _trainer(tmp_path, vlm_paths, arch)
    rows = prompt_data(2).to_list()
    rollout = _hand_built_rollout(trainer, rows, COMPLETIONS)
    model = trainer.model.eval()
    with torch.no_grad():
        logps, _ = trainer.completion_logps(model, rollout.batch(0, len(rollout)))
    processor = AutoProcessor.from_pretrained(vlm_paths[arch])
    for i, completion in enumerate(COMPLETIONS):
        expected = _reference_logps(model, processor, rows[i // 2], completion)
        torch.testing.assert_close(logps[i, : len(completion)].double(), expected, atol=2e-5, rtol=0)


def test_grpo_loss_of_hand_built_rollout_equals_float64_reference(tmp_path, vlm_paths):
    beta, eps = 0.2, 0.2
    trainer = _trainer(tmp_path, vlm_paths, "llava", beta=beta, epsilon=eps, loss_type="grpo")
    rows = prompt_data(2).to_list()
    rollout = _hand_built_rollout(trainer, rows, COMPLETIONS)
    processor = AutoProcessor.from_pretrained(vlm_paths["llava"])
    model = trainer.model.eval()
    logps = [_reference_logps(model, processor, rows[i // 2], c) for i, c in enumerate(COMPLETIONS)]
    generator = torch.Generator().manual_seed(0)
    width = rollout.completion_ids.shape[1]
    old = torch.zeros(len(COMPLETIONS), width, dtype=torch.float64)
    ref = torch.zeros_like(old)
    for i, lp in enumerate(logps):  # old / reference log-probs near the policy's, some outside the clip range
        old[i, : len(lp)] = lp + 0.3 * torch.randn(len(lp), generator=generator, dtype=torch.float64)
        ref[i, : len(lp)] = lp + 0.5 * torch.randn(len(lp), generator=generator, dtype=torch.float64)
    advantages = torch.tensor([1.0, -1.0, 0.5, -0.5], dtype=torch.float64)
    rollout.old_logps, rollout.ref_logps, rollout.advantages = old.float(), ref.float(), advantages.float()
    batch = rollout.batch(0, len(rollout))
    batch.update(total_sequences=len(COMPLETIONS), total_tokens=float(rollout.loss_mask.sum()))
    with torch.no_grad():
        loss = trainer.compute_loss(model, batch)
    expected = 0.0
    for i, lp in enumerate(logps):  # loss_type "grpo": per-sequence token mean, then mean over sequences
        ratio = torch.exp(lp - old[i, : len(lp)])
        a = advantages[i]
        surrogate = torch.minimum(ratio * a, ratio.clamp(1 - eps, 1 + eps) * a)
        delta = ref[i, : len(lp)] - lp
        kl = (torch.exp(delta) - delta - 1) * ratio  # use_bias_correction_kl=True (TRL's default): times r
        expected += (-surrogate + beta * kl).mean().item() / len(COMPLETIONS)
    assert loss.item() == pytest.approx(expected, abs=1e-5)


def test_generation_gets_each_prompts_pixels(tmp_path, vlm_paths):
    """The prefill forward of generate() sees, for every completion, its own prompt's pixel values (a random tiny
    model's samples barely depend on the image, so the inputs themselves are checked)."""
    trainer = _trainer(tmp_path, vlm_paths, "llava", max_completion_length=3)
    model, calls, seen = trainer.model, [], []
    hooks = [
        model.register_forward_pre_hook(
            lambda module, args, kwargs: calls.append({k: v for k, v in kwargs.items() if isinstance(v, torch.Tensor)}),
            with_kwargs=True,
        ),
        model.model.vision_tower.register_forward_pre_hook(
            lambda module, args, kwargs: seen.append(kwargs.get("pixel_values", args[0] if args else None)),
            with_kwargs=True,
        ),
    ]
    rows = prompt_data(2).to_list()
    try:
        episodes = trainer.image_prompts.generate(trainer.generation_backend, rows, 2, trainer.sampling, [1, 2])
    finally:
        for hook in hooks:
            hook.remove()
    processor = AutoProcessor.from_pretrained(vlm_paths["llava"])
    pixels = [
        processor.image_processor(images=[open_image(row["images"][0])], return_tensors="pt")["pixel_values"]
        for row in rows
    ]
    assert len(seen) == 1 and seen[0].shape[0] == 4  # the images are encoded once, for the prefill
    for i in range(4):  # prompt-major: completions 0, 1 of prompt 0, then 2, 3 of prompt 1
        torch.testing.assert_close(seen[0][i], pixels[i // 2][0])
    prefill, image_token = calls[0], model.config.image_token_id
    assert prefill["input_ids"].eq(image_token).sum(1).tolist() == [16] * 4  # 32 px / 8 px patches
    assert all(image_token not in e.token_ids for e in episodes)  # image tokens are never sampled
    assert [e.prompt_ids for e in episodes[::2]] == [
        ids.tolist() for ids in (r[m.bool()] for r, m in zip(prefill["input_ids"][::2], prefill["attention_mask"][::2]))
    ]


def test_plain_text_prompts_with_placeholders_train(tmp_path, vlm_paths):
    trainer = GRPOTrainer(
        vlm_paths["llava"],
        reward_funcs=length_reward,
        args=online_args(tmp_path, GRPOConfig, max_steps=1),
        train_dataset=prompt_data(4, conversational=False),
    )
    trainer.train()
    assert trainer.rollout.prompt_ids.eq(trainer.model.config.image_token_id).sum(1).eq(16).all()


# -- bad input -----------------------------------------------------------------------------------------------
def test_images_with_a_text_only_model_are_refused(tmp_path, tiny_model_path):
    with pytest.raises(ConfigError, match="text-only"):
        GRPOTrainer(
            tiny_model_path,
            reward_funcs=length_reward,
            args=online_args(tmp_path, GRPOConfig),
            train_dataset=prompt_data(4),
        )


def test_a_tokenizer_instead_of_the_processor_is_refused(tmp_path, vlm_paths):
    processor = AutoProcessor.from_pretrained(vlm_paths["llava"])
    with pytest.raises(ConfigError, match="processor"):
        GRPOTrainer(
            vlm_paths["llava"],
            reward_funcs=length_reward,
            args=online_args(tmp_path, GRPOConfig),
            train_dataset=prompt_data(4),
            processing_class=processor.tokenizer,
        )


def test_placeholder_count_mismatch_names_the_row(tmp_path, vlm_paths):
    data = prompt_data(4, conversational=False).to_list()
    data[2]["prompt"] = "no placeholder here"
    with pytest.raises(DataError, match="Row 2"):
        GRPOTrainer(
            vlm_paths["llava"],
            reward_funcs=length_reward,
            args=online_args(tmp_path, GRPOConfig),
            train_dataset=Dataset.from_list(data),
        )


def test_missing_image_file_names_the_row(tmp_path, vlm_paths):
    data = []
    for i in range(4):
        image(i).save(tmp_path / f"{i}.png")
        data.append({"images": [str(tmp_path / f"{i}.png")], "prompt": [{"role": "user", "content": "what is it"}]})
    data[3]["images"] = [str(tmp_path / "missing.png")]
    with pytest.raises(DataError, match="Row 3.*does not exist"):
        GRPOTrainer(
            vlm_paths["llava"],
            reward_funcs=length_reward,
            args=online_args(tmp_path, GRPOConfig),
            train_dataset=Dataset.from_list(data),
        )


@pytest.mark.parametrize("option", ["use_vllm", "use_transformers_continuous_batching"])
def test_generation_backends_without_image_inputs_are_refused(tmp_path, vlm_paths, option):
    with pytest.raises(ConfigError, match=option):
        GRPOTrainer(
            vlm_paths["llava"],
            reward_funcs=length_reward,
            args=online_args(tmp_path, GRPOConfig, **{option: True}),
            train_dataset=prompt_data(4),
        )


def test_trainers_without_image_support_refuse_images(tmp_path, vlm_paths):
    from posttrain.experimental.online_dpo import OnlineDPOConfig, OnlineDPOTrainer

    with pytest.raises(ConfigError, match="does not train on image prompts"):
        OnlineDPOTrainer(
            vlm_paths["llava"],
            reward_funcs=length_reward,
            args=OnlineDPOConfig(**common_args(tmp_path, max_completion_length=4)),
            train_dataset=prompt_data(4),
        )


def test_max_prompt_length_that_cuts_image_tokens_is_refused(tmp_path, vlm_paths):
    trainer = _trainer(tmp_path, vlm_paths, "llava", max_prompt_length=8)
    with pytest.raises(DataError, match="max_prompt_length=8 would cut image tokens"):
        trainer.train()
