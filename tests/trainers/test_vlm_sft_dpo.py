"""SFT and DPO train vision-language models: each tiny architecture trains, the loss of a hand-built batch equals a
float64 reference computed from the model's logits over the trained tokens only, the vision tower stays frozen by
default (LoRA: no adapter on it, the projector trained in full), and TRL 1.16 gives the same step-0 metrics."""

import sys

import pytest
import torch
import torch.nn.functional as F
from _vlm import ARCHS, common_args, messages_data, preference_data, prompt_completion_data, vlm_paths, vlm_ref_paths  # noqa: F401
from transformers import AutoModelForImageTextToText, AutoProcessor

from posttrain import DPOConfig, DPOTrainer, SFTConfig, SFTTrainer

TOWER = ("vision_tower", "vision_model")
PROJECTOR = ("multi_modal_projector", "connector")


def _params(model, names):
    return {n: p.detach().clone() for n, p in model.named_parameters() if any(f".{k}." in f".{n}" for k in names)}


def _changed(before, model):
    now = dict(model.named_parameters())
    return {n for n, p in before.items() if not torch.equal(p, now[n].detach())}


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("method", ["sft", "dpo"])
def test_trains_two_steps_with_the_tower_frozen(tmp_path, vlm_paths, arch, method):
    if method == "sft":
        trainer = SFTTrainer(
            vlm_paths[arch],
            args=SFTConfig(**common_args(tmp_path, assistant_only_loss=True)),
            train_dataset=messages_data(4),
        )
    else:
        trainer = DPOTrainer(vlm_paths[arch], args=DPOConfig(**common_args(tmp_path)), train_dataset=preference_data(4))
    tower, projector = _params(trainer.model, TOWER), _params(trainer.model, PROJECTOR)
    assert tower and projector
    trainer.train()
    losses = [log["loss"] for log in trainer.state.log_history if "loss" in log]
    assert len(losses) == 2 and all(torch.isfinite(torch.tensor(losses)))
    assert not _changed(tower, trainer.model)  # frozen
    assert _changed(projector, trainer.model) == set(projector)  # trained


def _eval_batch(trainer, rows):
    batch = trainer._prepare_inputs(trainer.data_collator(rows))
    trainer.model.eval()
    return batch


@pytest.mark.parametrize("arch", ARCHS)
def test_sft_loss_equals_float64_nll_over_trained_tokens(tmp_path, vlm_paths, arch):
    trainer = SFTTrainer(
        vlm_paths[arch], args=SFTConfig(**common_args(tmp_path)), train_dataset=prompt_completion_data(3)
    )
    batch = _eval_batch(trainer, prompt_completion_data(3).to_list())
    with torch.no_grad():
        loss = trainer.compute_loss(trainer.model, dict(batch))
        inputs = {k: v for k, v in batch.items() if k != "labels"}
        logits = trainer.model(**inputs).logits.double()
    labels = batch["labels"]
    total, count = 0.0, 0
    for r in range(labels.shape[0]):
        for t in range(1, labels.shape[1]):
            if labels[r, t] != -100:
                total -= torch.log_softmax(logits[r, t - 1], -1)[labels[r, t]].item()
                count += 1
    assert count == int((labels[:, 1:] != -100).sum()) > 0
    assert loss.item() == pytest.approx(total / count, abs=1e-5)


@pytest.mark.parametrize("arch", ARCHS)
def test_dpo_loss_equals_float64_reference(tmp_path, vlm_paths, vlm_ref_paths, arch):
    beta = 0.3
    trainer = DPOTrainer(
        vlm_paths[arch],
        ref_model=AutoModelForImageTextToText.from_pretrained(vlm_ref_paths[arch]),
        args=DPOConfig(**common_args(tmp_path, beta=beta)),
        train_dataset=preference_data(2),
    )
    batch = _eval_batch(trainer, preference_data(2).to_list())
    trainer.ref_model.eval()
    with torch.no_grad():
        loss = trainer.compute_loss(trainer.model, dict(batch))
        model_inputs = {k: v for k, v in batch.items() if k != "completion_mask"}
        logps = []
        for model in (trainer.model, trainer.ref_model):
            logp = torch.log_softmax(model(**model_inputs).logits.double(), -1)
            mask, ids = batch["completion_mask"], batch["input_ids"]
            logps.append(
                torch.tensor(
                    [
                        sum(logp[r, t - 1, ids[r, t]].item() for t in range(1, ids.shape[1]) if mask[r, t])
                        for r in range(ids.shape[0])
                    ],
                    dtype=torch.float64,
                )
            )
    (pc, pr), (rc, rr) = (x.chunk(2) for x in logps)
    expected = -F.logsigmoid(beta * ((pc - rc) - (pr - rr))).mean()
    assert abs((pc - rc) - (pr - rr)).max() > 1e-3  # the reference differs: the loss is not log 2
    assert loss.item() == pytest.approx(expected.item(), abs=1e-5)


@pytest.mark.parametrize("method", ["sft", "dpo"])
def test_lora_leaves_the_tower_alone_and_trains_the_projector(tmp_path, vlm_paths, method):
    from peft import LoraConfig

    peft_config = LoraConfig(r=4, target_modules="all-linear")
    if method == "sft":
        trainer = SFTTrainer(
            vlm_paths["llava"],
            args=SFTConfig(**common_args(tmp_path)),
            train_dataset=prompt_completion_data(4),
            peft_config=peft_config,
        )
    else:
        trainer = DPOTrainer(
            vlm_paths["llava"],
            args=DPOConfig(**common_args(tmp_path)),
            train_dataset=preference_data(4),
            peft_config=peft_config,
        )
    names = [n for n, _ in trainer.model.named_modules()]
    assert any("language_model" in n and "lora_A" in n for n in names)
    assert not any("vision_tower" in n and "lora" in n for n in names)
    assert peft_config.modules_to_save is None  # the caller's config is not modified
    trainable = [n for n, p in trainer.model.named_parameters() if p.requires_grad]
    assert any("multi_modal_projector" in n and "modules_to_save" in n for n in trainable)
    assert not any("vision_tower" in n for n in trainable)
    tower = _params(trainer.model, ("vision_tower",))
    trainer.train()
    assert not _changed(tower, trainer.model)


def test_the_tower_trains_when_asked(tmp_path, vlm_paths):
    trainer = SFTTrainer(
        vlm_paths["llava"],
        args=SFTConfig(**common_args(tmp_path, freeze_vision_tower=False)),
        train_dataset=prompt_completion_data(4),
    )
    tower = _params(trainer.model, ("vision_tower",))
    trainer.train()
    assert _changed(tower, trainer.model)


def test_qwen2_vl_batch_goes_through_the_loss(tmp_path):
    """Qwen2-VL's processor needs torchvision (absent here): a hand-built batch (grid, mm_token_type_ids) checks that
    the trainer hands the model its image inputs, and the loss against the float64 reference."""
    from datasets import Dataset

    from posttrain.models.tiny_vlm import build_tiny_qwen2_vl_model
    from posttrain.models.vision import freeze_vision_tower

    model, tokenizer = build_tiny_qwen2_vl_model()
    text = Dataset.from_list([{"prompt": "what", "completion": " one"}] * 2)
    trainer = SFTTrainer(model, args=SFTConfig(**common_args(tmp_path)), train_dataset=text, processing_class=tokenizer)
    ids = tokenizer.convert_tokens_to_ids
    image_tokens = [ids("<|vision_start|>")] + [ids("<|image_pad|>")] * 4 + [ids("<|vision_end|>")]
    text_ids = tokenizer("what is it one two")["input_ids"]
    input_ids = torch.tensor([image_tokens + text_ids])
    labels = input_ids.clone()
    labels[0, : len(image_tokens) + 3] = -100
    torch.manual_seed(0)
    batch = {
        "input_ids": input_ids,
        "attention_mask": torch.ones_like(input_ids),
        "labels": labels,
        "pixel_values": torch.randn(16, 3 * 2 * 4 * 4),
        "image_grid_thw": torch.tensor([[1, 4, 4]]),
        "mm_token_type_ids": (input_ids == ids("<|image_pad|>")).long(),
    }
    trainer.model.eval()
    with torch.no_grad():
        loss = trainer.compute_loss(trainer.model, dict(batch))
        logits = trainer.model(**{k: v for k, v in batch.items() if k != "labels"}).logits.double()
        other_image = dict(batch, pixel_values=torch.randn(16, 3 * 2 * 4 * 4))
        other_loss = trainer.compute_loss(trainer.model, other_image)
    trained = (labels[0, 1:] != -100).nonzero().flatten()
    expected = -torch.log_softmax(logits[0, trained], -1).gather(-1, labels[0, trained + 1, None]).mean()
    assert loss.item() == pytest.approx(expected.item(), abs=1e-5)
    assert abs(other_loss.item() - loss.item()) > 1e-6  # the pixels reach the model
    frozen = freeze_vision_tower(model)
    assert frozen == ["model.visual"]
    assert all(p.requires_grad == (".merger." in n) for n, p in model.named_parameters() if "visual" in n)


@pytest.fixture()
def qwen2_vl(monkeypatch):
    return _qwen2_vl(monkeypatch)


def _qwen2_vl(monkeypatch):
    """A tiny Qwen2-VL with its real `Qwen2VLProcessor`, whose construction is let past the video-processor class
    check that needs torchvision (no video is ever processed)."""
    from transformers import ProcessorMixin, Qwen2VLProcessor

    from posttrain.models.tiny_vlm import build_tiny_qwen2_vl_model, qwen2_vl_processor_parts

    check = ProcessorMixin.check_argument_for_proper_class
    monkeypatch.setattr(
        ProcessorMixin,
        "check_argument_for_proper_class",
        lambda self, name, arg: None if arg is None else check(self, name, arg),
    )
    model, tokenizer = build_tiny_qwen2_vl_model()
    image_processor, tokenizer = qwen2_vl_processor_parts(tokenizer)
    processor = Qwen2VLProcessor(
        image_processor=image_processor,
        tokenizer=tokenizer,
        video_processor=None,
        chat_template=tokenizer.chat_template,
    )
    return model, processor


def test_qwen2_vl_masks_and_training(tmp_path, qwen2_vl):
    from posttrain.data.vision import VisionPreferenceCollator, VisionSFTCollator

    model, processor = qwen2_vl
    tok = processor.tokenizer
    batch = VisionSFTCollator(processor, assistant_only_loss=True)(messages_data(2).to_list())
    pad_id = tok.convert_tokens_to_ids("<|image_pad|>")
    assert batch["image_grid_thw"].tolist() == [[1, 8, 8]] * 2 and int((batch["input_ids"] == pad_id).sum()) == 32
    assert torch.equal(batch["mm_token_type_ids"], (batch["input_ids"] == pad_id).long())
    for r in range(2):
        trained = [int(t) for t, lab in zip(batch["input_ids"][r], batch["labels"][r]) if lab != -100]
        assert tok.decode(trained) == f"digit {r}<|im_end|>"
    pref = VisionPreferenceCollator(processor)(preference_data(2).to_list())
    assert pref["image_grid_thw"].shape[0] == 4 and pref["pixel_values"].shape[0] == 4 * 64
    losses = []
    for trainer_cls, config, data in (
        (SFTTrainer, SFTConfig, messages_data(4)),
        (DPOTrainer, DPOConfig, preference_data(4)),
    ):
        trainer = trainer_cls(
            model, args=config(**common_args(tmp_path)), train_dataset=data, processing_class=processor
        )
        merger = _params(trainer.model, ("merger",))
        blocks = {n: p for n, p in _params(trainer.model, ("visual",)).items() if ".merger." not in n}
        trainer.train()
        losses += [log["loss"] for log in trainer.state.log_history if "loss" in log]
        assert not _changed(blocks, trainer.model) and _changed(merger, trainer.model) == set(merger)
    assert len(losses) == 4 and all(torch.isfinite(torch.tensor(losses)))
    from peft import LoraConfig

    lora = SFTTrainer(
        model,
        args=SFTConfig(**common_args(tmp_path)),
        train_dataset=messages_data(2),
        processing_class=processor,
        peft_config=LoraConfig(r=4, target_modules="all-linear"),
    )
    trainable = [n for n, p in lora.model.named_parameters() if p.requires_grad]
    assert any(".merger." in n and "modules_to_save" in n for n in trainable)
    assert not any("visual" in n and "lora" in n for n in trainable)


@pytest.mark.parametrize("arch", ARCHS + ("qwen2_vl",))
@pytest.mark.parametrize("method", ["sft", "dpo"])
def test_step0_metrics_equal_trls(tmp_path, vlm_paths, vlm_ref_paths, monkeypatch, arch, method):
    sys.path.insert(0, "tests")
    from _trl import import_trl

    trl = import_trl("sft_trainer", "dpo_trainer")
    common = common_args(
        tmp_path, per_device_train_batch_size=4, max_steps=1, max_length=None, gradient_checkpointing=False
    )
    logs = []
    for name, lib in (("trl", trl), ("posttrain", sys.modules["posttrain"])):
        if arch == "qwen2_vl":
            from posttrain.models.tiny_vlm import build_tiny_qwen2_vl_model

            model, processor = _qwen2_vl(monkeypatch)
            ref = build_tiny_qwen2_vl_model(seed=1)[0]
        else:
            model = AutoModelForImageTextToText.from_pretrained(vlm_paths[arch])
            processor = AutoProcessor.from_pretrained(vlm_paths[arch])
            ref = AutoModelForImageTextToText.from_pretrained(vlm_ref_paths[arch])
        common["output_dir"] = str(tmp_path / name)
        if method == "sft":
            trainer = lib.SFTTrainer(
                model, args=lib.SFTConfig(**common), train_dataset=prompt_completion_data(4), processing_class=processor
            )
        else:
            trainer = lib.DPOTrainer(
                model,
                ref_model=ref,
                args=lib.DPOConfig(**common),
                train_dataset=preference_data(4),
                processing_class=processor,
            )
        trainer.train()
        logs.append(trainer.state.log_history[0])
    theirs, ours = logs
    keys = ("loss", "entropy", "mean_token_accuracy", "num_tokens") + (
        () if method == "sft" else ("logps/chosen", "logps/rejected", "rewards/margins", "logits/chosen")
    )
    for key in keys:
        assert ours[key] == pytest.approx(theirs[key], abs=1e-5, rel=1e-6), key


def test_llava_from_a_causal_lm_keeps_its_weights_and_trains(tmp_path, tiny_model_path):
    from transformers import AutoModelForCausalLM

    from posttrain.models.tiny_vlm import build_llava_from_causal_lm

    path = build_llava_from_causal_lm(tiny_model_path, tmp_path / "llava", vision_hidden_size=32)
    lm = AutoModelForCausalLM.from_pretrained(tiny_model_path)
    vlm = AutoModelForImageTextToText.from_pretrained(path)
    source = lm.model.state_dict()
    for name, value in vlm.model.language_model.state_dict().items():
        if name == "embed_tokens.weight":  # one more row: the <image> token
            assert value.shape[0] == source[name].shape[0] + 1 and torch.equal(value[:-1], source[name])
        else:
            assert torch.equal(value, source[name]), name
    trainer = SFTTrainer(
        path, args=SFTConfig(**common_args(tmp_path, max_steps=1)), train_dataset=prompt_completion_data(2)
    )
    trainer.train()
    assert torch.isfinite(torch.tensor(trainer.state.log_history[0]["loss"]))


@pytest.mark.parametrize("arch", ARCHS + ("qwen2_vl",))
def test_per_row_image_inputs_split_and_merge_for_any_row_selection(vlm_paths, monkeypatch, arch):
    """What the online engine needs: a prompt's image inputs cut out of a batch and re-batched with any other rows
    (repeated once per completion) give the model exactly what processing those rows together gives."""
    from _vlm import image
    from datasets import Dataset

    from posttrain.data.vision import VisionSFTCollator, merge_vision_inputs, split_vision_inputs

    if arch == "qwen2_vl":
        model, processor = _qwen2_vl(monkeypatch)
    else:
        model = AutoModelForImageTextToText.from_pretrained(vlm_paths[arch])
        processor = AutoProcessor.from_pretrained(vlm_paths[arch])
    counts = [1, 2, 1]
    rows = Dataset.from_list(
        [
            {
                "images": [image(10 * r + k) for k in range(n)],
                "messages": [
                    {"role": "user", "content": [{"type": "image"}] * n + [{"type": "text", "text": f"row {r}"}]},
                    {"role": "assistant", "content": [{"type": "text", "text": "yes"}]},
                ],
            }
            for r, n in enumerate(counts)
        ]
    ).to_list()
    batch = VisionSFTCollator(processor)(rows)
    parts = split_vision_inputs(batch, counts)
    order = [2, 1, 1, 0]
    merged = merge_vision_inputs([parts[r] for r in order])
    token_inputs = {
        k: batch[k][order] for k in ("input_ids", "attention_mask", "token_type_ids", "mm_token_type_ids") if k in batch
    }
    model.eval()
    with torch.no_grad():
        full = model(**{k: v for k, v in batch.items() if k != "labels"}).logits
        selected = model(**token_inputs, **merged).logits
    mask = token_inputs["attention_mask"].bool()
    assert torch.allclose(selected[mask], full[order][mask], atol=1e-5)


def test_a_vision_model_trains_on_text_only_rows_with_its_processor(tmp_path, vlm_paths):
    from datasets import Dataset

    text = Dataset.from_list(
        [
            {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": f"digit {i}"}]}
            for i in range(2)
        ]
    )
    processor = AutoProcessor.from_pretrained(vlm_paths["llava"])
    trainer = SFTTrainer(
        vlm_paths["llava"],
        args=SFTConfig(**common_args(tmp_path, max_steps=1)),
        train_dataset=text,
        processing_class=processor,
    )
    assert "input_ids" in trainer.train_dataset.column_names  # tokenized ahead, as text data is
    trainer.train()
    trainer.save_model(str(tmp_path / "saved"))
    assert type(AutoProcessor.from_pretrained(tmp_path / "saved")) is type(processor)
    assert not hasattr(processor, "pad_token")  # the processor is left as it was
