"""Vision data: images opened from every form TRL datasets use, bad rows refused before training naming the row,
and the collators' masks checked token by token (image tokens never trained)."""

import io

import pytest
import torch
from _vlm import (
    ARCHS,
    IMAGE_TOKENS,
    PLACEHOLDER,
    common_args,
    image,
    messages_data,
    preference_data,
    prompt_completion_data,
    vlm_paths,
)  # noqa: F401
from datasets import Dataset, Features, Image, List, Value
from transformers import AutoProcessor

from posttrain import DPOConfig, DPOTrainer, SFTConfig, SFTTrainer
from posttrain.data.vision import VisionPreferenceCollator, VisionSFTCollator, open_image
from posttrain.errors import ConfigError, DataError


def _png(tmp_path, i=0):
    path = tmp_path / f"img{i}.png"
    image(i).save(path)
    return str(path)


def test_open_image_reads_pil_paths_bytes_and_datasets_dicts(tmp_path):
    path = _png(tmp_path)
    raw = open(path, "rb").read()
    expected = list(image(0).getdata())
    for value in (image(0), path, raw, {"bytes": raw, "path": None}, {"bytes": None, "path": path}):
        opened = open_image(value)
        assert opened.mode == "RGB" and list(opened.getdata()) == expected
    gray = io.BytesIO()
    image(0).convert("L").save(gray, format="PNG")
    assert open_image(gray.getvalue()).mode == "RGB"


def _sft(path, data, tmp_path, **kw):
    return SFTTrainer(path, args=SFTConfig(**common_args(tmp_path, **kw)), train_dataset=data)


def test_missing_and_corrupt_files_are_refused_naming_the_row(tmp_path, vlm_paths):
    good = _png(tmp_path)
    rows = [
        {"images": [good], "messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "a"}]}
        for _ in range(3)
    ]
    rows[2]["images"] = [str(tmp_path / "nope.png")]
    with pytest.raises(DataError, match=r"Row 2.*nope\.png.*does not exist"):
        _sft(vlm_paths["llava"], Dataset.from_list(rows), tmp_path)
    corrupt = tmp_path / "bad.png"
    corrupt.write_bytes(b"\x89PNG\r\n\x1a\n not an image")
    rows[2]["images"] = [str(corrupt)]
    with pytest.raises(DataError, match=r"Row 2.*cannot be read"):
        _sft(vlm_paths["llava"], Dataset.from_list(rows), tmp_path)
    # A datasets Image column is checked without decoding the whole dataset, corrupt bytes included.
    features = Features({"images": List(Image()), "messages": [{"role": Value("string"), "content": Value("string")}]})
    rows[2]["images"] = [{"bytes": b"garbage", "path": None}]
    with pytest.raises(DataError, match=r"Row 2.*cannot be read"):
        _sft(vlm_paths["llava"], Dataset.from_list(rows, features=features), tmp_path)


def test_image_count_must_match_the_placeholders(tmp_path, vlm_paths):
    two_blocks = [
        {"role": "user", "content": [{"type": "image"}, {"type": "image"}, {"type": "text", "text": "hi"}]},
        {"role": "assistant", "content": [{"type": "text", "text": "a"}]},
    ]
    ok = {"images": [image(0)], "messages": [{**two_blocks[0], "content": two_blocks[0]["content"][1:]}, two_blocks[1]]}
    data = Dataset.from_list([ok, {"images": [image(1)], "messages": two_blocks}])
    with pytest.raises(DataError, match=r"Row 1.*\(1\).*placeholders \(2\)"):
        _sft(vlm_paths["llava"], data, tmp_path)
    text = Dataset.from_list([{"images": [image(0)], "text": "<image> one"}, {"images": [image(1)], "text": "none"}])
    with pytest.raises(DataError, match=r"Row 1 of train_dataset has 1 image\(s\) but 0 image placeholder"):
        _sft(vlm_paths["llava"], text, tmp_path)
    pref = preference_data(2).to_list()
    pref[0]["chosen"] = [{"role": "assistant", "content": [{"type": "text", "text": "x"}]}]
    pref[1]["chosen"] = [{"role": "assistant", "content": [{"type": "image"}, {"type": "text", "text": "x"}]}]
    with pytest.raises(DataError, match=r"Row 1.*'chosen' holds image blocks"):
        DPOTrainer(vlm_paths["llava"], args=DPOConfig(**common_args(tmp_path)), train_dataset=Dataset.from_list(pref))


def test_images_need_a_vision_language_model_and_its_processor(tmp_path, vlm_paths, tiny_model_path):
    with pytest.raises(ConfigError, match="text-only model"):
        _sft(tiny_model_path, messages_data(2), tmp_path)
    tokenizer = AutoProcessor.from_pretrained(vlm_paths["llava"]).tokenizer
    with pytest.raises(ConfigError, match="processing_class must be the model's processor"):
        SFTTrainer(
            vlm_paths["llava"],
            args=SFTConfig(**common_args(tmp_path)),
            train_dataset=messages_data(2),
            processing_class=tokenizer,
        )


@pytest.mark.parametrize(
    "option, value, match",
    [
        ("packing", True, "packing=True is not supported with images"),
        ("padding_free", True, "padding_free=True is not supported with images"),
        ("truncation_mode", "keep_end", "keep_end"),
        ("chunked_loss", True, "chunked_loss=True is not supported with images"),
    ],
)
def test_options_the_image_path_cannot_honour_are_refused(tmp_path, vlm_paths, option, value, match):
    with pytest.raises(ConfigError, match=match):
        _sft(vlm_paths["llava"], messages_data(2), tmp_path, **{option: value})


def test_dpo_refuses_what_the_image_path_cannot_honour(tmp_path, vlm_paths):
    for option, value, match in (
        ("precompute_ref_log_probs", True, "precompute_ref_log_probs=True is not supported"),
        ("padding_free", True, "padding_free=True is not supported with images"),
        ("max_prompt_length", 8, "max_prompt_length is not applied to image rows"),
    ):
        with pytest.raises(ConfigError, match=match):
            DPOTrainer(
                vlm_paths["llava"],
                args=DPOConfig(**common_args(tmp_path, **{option: value})),
                train_dataset=preference_data(2),
            )
    implicit = preference_data(2).remove_columns("prompt")
    with pytest.raises(ConfigError, match="no 'prompt' column"):
        DPOTrainer(vlm_paths["llava"], args=DPOConfig(**common_args(tmp_path)), train_dataset=implicit)


def test_ddp_looks_for_unused_parameters_with_a_vision_model(tmp_path, vlm_paths):
    trainer = _sft(vlm_paths["llava"], messages_data(2), tmp_path)
    assert trainer.args.ddp_find_unused_parameters is True


def _trained_text(tokenizer, ids, labels):
    return tokenizer.decode([int(t) for t, lab in zip(ids, labels) if lab != -100])


@pytest.mark.parametrize("arch", ARCHS)
def test_sft_collator_trains_every_token_but_image_tokens_and_padding(vlm_paths, arch):
    processor = AutoProcessor.from_pretrained(vlm_paths[arch])
    tok = processor.tokenizer
    rows = messages_data(2).to_list()
    batch = VisionSFTCollator(processor, completion_only_loss=False)(rows)
    image_ids = {tok.convert_tokens_to_ids(t) for t in IMAGE_TOKENS[arch]}
    for r, row in enumerate(rows):
        ids, labels, attention = batch["input_ids"][r], batch["labels"][r], batch["attention_mask"][r]
        for token, count in IMAGE_TOKENS[arch].items():  # the processor expanded the image
            assert int((ids == tok.convert_tokens_to_ids(token)).sum()) == count
        rendered = "".join(
            f"<|im_start|>{m['role']}\n"
            + (PLACEHOLDER[arch] if m["role"] == "user" else "")
            + m["content"]
            + "<|im_end|>\n"
            for m in row["messages"]
        )
        # Trained: exactly the conversation's own text (the image placeholder and its expansion are not).
        assert _trained_text(tok, ids, labels) == rendered.replace(PLACEHOLDER[arch], "")
        for t in range(len(ids)):
            if int(ids[t]) in image_ids or attention[t] == 0:
                assert labels[t] == -100
    if arch == "gemma3":  # token_type_ids mark the image's soft tokens
        soft = tok.convert_tokens_to_ids("<image_soft_token>")
        assert torch.equal(batch["token_type_ids"], (batch["input_ids"] == soft).long())


@pytest.mark.parametrize("arch", ARCHS)
def test_assistant_and_completion_only_masks_hold(vlm_paths, arch):
    processor = AutoProcessor.from_pretrained(vlm_paths[arch])
    tok = processor.tokenizer
    rows = messages_data(3).to_list()
    batch = VisionSFTCollator(processor, assistant_only_loss=True)(rows)
    for r in range(3):
        assert _trained_text(tok, batch["input_ids"][r], batch["labels"][r]) == f"digit {r}<|im_end|>"
    rows = prompt_completion_data(3).to_list()
    batch = VisionSFTCollator(processor, completion_only_loss=True)(rows)
    for r in range(3):
        assert _trained_text(tok, batch["input_ids"][r], batch["labels"][r]) == f"digit {r}<|im_end|>\n"
    full = VisionSFTCollator(processor, completion_only_loss=False)(rows)
    assert (
        _trained_text(tok, full["input_ids"][1], full["labels"][1])
        == "<|im_start|>user\nwhat is it<|im_end|>\n<|im_start|>assistant\ndigit 1<|im_end|>\n"
    )


def test_standard_text_with_placeholders(vlm_paths):
    processor = AutoProcessor.from_pretrained(vlm_paths["llava"])
    rows = [
        {"images": [image(0)], "text": "<image>one two"},
        {"images": [image(1), image(2)], "text": "<image> and <image> three"},
    ]
    batch = VisionSFTCollator(processor)(rows)
    assert batch["pixel_values"].shape[0] == 3
    assert [_trained_text(processor.tokenizer, batch["input_ids"][r], batch["labels"][r]) for r in (0, 1)] == [
        "one two",
        " and  three",
    ]


@pytest.mark.parametrize("arch", ARCHS)
def test_preference_collator_masks_and_images(vlm_paths, arch):
    processor = AutoProcessor.from_pretrained(vlm_paths[arch])
    tok = processor.tokenizer
    rows = preference_data(2).to_list()
    batch = VisionPreferenceCollator(processor)(rows)
    assert batch["input_ids"].shape[0] == 4
    expected = [
        "digit 0<|im_end|>\n",
        "digit 1<|im_end|>\n",
        "a cat 1 is here<|im_end|>\n",
        "a cat 2 is here<|im_end|>\n",
    ]
    for r in range(4):
        labels = batch["input_ids"][r].masked_fill(batch["completion_mask"][r] == 0, -100)
        assert _trained_text(tok, batch["input_ids"][r], labels) == expected[r]
    half = batch["pixel_values"].shape[0] // 2  # each row's images go with its chosen and its rejected sequence
    assert torch.equal(batch["pixel_values"][:half], batch["pixel_values"][half:])
    assert not torch.equal(batch["pixel_values"][0], batch["pixel_values"][1])


def test_max_length_that_cuts_image_tokens_is_an_error(vlm_paths):
    processor = AutoProcessor.from_pretrained(vlm_paths["llava"])
    rows = messages_data(1).to_list()
    with pytest.raises(DataError, match="max_length=10 cuts image tokens"):
        VisionSFTCollator(processor, max_length=10)(rows)
    batch = VisionSFTCollator(processor, max_length=30)(rows)  # the image survives, the answer is cut
    assert batch["input_ids"].shape[1] == 30


def test_datasets_image_column_from_files_trains(tmp_path, vlm_paths):
    paths = [_png(tmp_path, i) for i in range(2)]
    data = Dataset.from_list(
        [{"image": p, "prompt": "<image>what", "completion": f" {i}"} for i, p in enumerate(paths)]
    ).cast_column("image", Image())
    trainer = _sft(vlm_paths["llava"], data, tmp_path, max_steps=1)
    batch = trainer.data_collator([trainer.train_dataset[0], trainer.train_dataset[1]])
    assert batch["pixel_values"].shape == (2, 3, 32, 32)
    trainer.train()
