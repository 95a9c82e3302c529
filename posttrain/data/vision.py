"""Images in the offline trainers (SFT, DPO): validation, image loading, processor calls and the collators.

A vision dataset has an ``images`` column (a list per row) or an ``image`` column (one per row) beside TRL's text
formats; conversations mark where images go with ``{"type": "image"}`` content blocks, or get one block per image
before the first user message (`prepare_multimodal_messages`). Images are opened and turned into pixel values in
the collator, a batch at a time: the dataset itself is only validated (each row's image count against its
placeholders, each file opened and verified), never materialised.

Image tokens are never trained: the tokens a processor inserts for an image, and its placeholder tokens, get
label -100 (SFT) / completion mask 0 (DPO). The trained tokens of a rendered conversation are found on its text
(`tokenize.assistant_spans`), tokenized without the image expansion, and carried over to the processor's ids by
aligning the two token sequences (the expansion only inserts tokens).
"""

from __future__ import annotations

import contextlib
import difflib
import io
import os
from dataclasses import dataclass

import torch

from posttrain.data.chat import apply_chat_template, render
from posttrain.data.tokenize import assistant_spans, tokenize_with_spans
from posttrain.data.transforms import prepare_multimodal_messages
from posttrain.errors import ConfigError, DataError

IMAGE_COLUMNS = ("images", "image")
# Per-token inputs some architectures take beside input_ids (Gemma 3, Qwen2-VL); padded with 0.
TOKEN_INPUTS = ("token_type_ids", "mm_token_type_ids")
# Batch keys that go to the model's forward besides input_ids / attention_mask / position_ids.
VISION_INPUTS = (
    "pixel_values",
    "pixel_attention_mask",
    "image_sizes",
    "image_grid_thw",
    "image_position_ids",
    "pixel_values_videos",
    "video_grid_thw",
    *TOKEN_INPUTS,
)
# Processor attributes naming image special tokens (never trained).
_IMAGE_TOKEN_ATTRIBUTES = (
    "image_token",
    "boi_token",
    "eoi_token",
    "fake_image_token",
    "global_image_tag",
    "image_start_token",
    "image_end_token",
    "vision_start_token",
    "vision_end_token",
)
IGNORE_INDEX = -100


# -- what the inputs are ---------------------------------------------------------------------------------
def is_processor(processing_class) -> bool:
    from transformers import ProcessorMixin

    return isinstance(processing_class, ProcessorMixin)


def tokenizer_of(processing_class):
    """The text tokenizer: a processor's `tokenizer`, or the tokenizer itself."""
    return processing_class.tokenizer if is_processor(processing_class) else processing_class


def is_vision_dataset(dataset) -> bool:
    columns = getattr(dataset, "column_names", None) or []
    return any(c in columns for c in IMAGE_COLUMNS)


def is_vision_model(model) -> bool:
    config = getattr(model, "config", None)
    return config is not None and getattr(config, "vision_config", None) is not None


def check_vision_inputs(model, processing_class, dataset, name: str = "train_dataset") -> None:
    """Images need a vision-language model and its processor: refused before training otherwise."""
    column = next(c for c in IMAGE_COLUMNS if c in dataset.column_names)
    if model is not None and not isinstance(model, str) and not is_vision_model(model):
        raise ConfigError(
            f"{name} has an {column!r} column, but {type(model).__name__} is a text-only model (its "
            "config has no vision_config). Train a vision-language model, or drop the column "
            f"(dataset.remove_columns({column!r}))."
        )
    if not is_processor(processing_class):
        raise ConfigError(
            f"{name} has an {column!r} column, so processing_class must be the model's processor "
            f"(AutoProcessor.from_pretrained(...)), not {type(processing_class).__name__}, which cannot "
            "turn images into pixel values."
        )


@contextlib.contextmanager
def pad_token_view(processing_class):
    """A processor exposes its tokenizer's pad token while the shared trainer set-up reads `pad_token`."""
    if not is_processor(processing_class) or "pad_token" in vars(processing_class):
        yield
        return
    processing_class.pad_token = processing_class.tokenizer.pad_token
    try:
        yield
    finally:
        vars(processing_class).pop("pad_token", None)


# -- images ----------------------------------------------------------------------------------------------
def row_images(example: dict) -> list:
    if "images" in example:
        images = example["images"]
        return [] if images is None else list(images) if isinstance(images, (list, tuple)) else [images]
    image = example.get("image")
    return [] if image is None else [image]


def open_image(value, row: int | None = None, verify: bool = False):
    """A PIL image from a PIL image, a file path, bytes, or a datasets Image dict ({"bytes", "path"})."""
    from PIL import Image

    where = f"Row {row}: " if row is not None else ""
    if isinstance(value, Image.Image):
        return value
    if isinstance(value, dict):
        value = value.get("bytes") or value.get("path")
    try:
        if isinstance(value, (bytes, bytearray)):
            image = Image.open(io.BytesIO(value))
        elif isinstance(value, (str, os.PathLike)):
            if not os.path.exists(value):
                raise DataError(f"{where}image file {str(value)!r} does not exist. Fix the path or drop the row.")
            image = Image.open(value)
        else:
            raise DataError(
                f"{where}an image must be a PIL image, a file path, bytes or a {{'bytes', 'path'}} dict; "
                f"got {type(value).__name__}."
            )
        if verify:
            image.verify()
            return None
        return image.convert("RGB") if image.mode != "RGB" else image
    except DataError:
        raise
    except Exception as error:  # PIL raises many types for unreadable data
        raise DataError(
            f"{where}the image {str(value)[:80]!r} cannot be read ({type(error).__name__}: {error}). "
            "Fix or drop the row."
        ) from error


def _undecoded(dataset):
    """The dataset with its datasets.Image columns left as {"bytes", "path"} (validation opens them itself)."""
    from datasets import Image, List, Sequence

    for column in IMAGE_COLUMNS:
        feature = dataset.features.get(column) if dataset.features else None
        if isinstance(feature, Image):
            dataset = dataset.cast_column(column, Image(decode=False))
        elif isinstance(feature, (List, Sequence)) and isinstance(feature.feature, Image):
            dataset = dataset.cast_column(column, List(Image(decode=False)))
    return dataset


def _image_blocks(messages) -> int:
    return sum(
        1
        for m in messages
        if isinstance(m.get("content"), list)
        for part in m["content"]
        if isinstance(part, dict) and part.get("type") == "image"
    )


def validate_vision_dataset(
    dataset, processor, accepted, trainer: str, name: str = "train_dataset", text_field: str = "text"
):
    """Checks every row before training: the format, one image placeholder per image, and every image readable.
    Returns the dataset format."""
    from posttrain.data.formats import validate_dataset

    text_only = dataset.select_columns([c for c in dataset.column_names if c not in IMAGE_COLUMNS])
    if text_field != "text" and text_field in text_only.column_names:
        text_only = text_only.remove_columns([c for c in ("text",) if c in text_only.column_names])
        text_only = text_only.rename_column(text_field, "text")
    fmt = validate_dataset(text_only, accepted, trainer, name)
    text_columns = [text_field if c == "text" else c for c in fmt.columns]
    placeholder = getattr(processor, "image_token", None)
    for row, example in enumerate(_undecoded(dataset)):
        images = row_images(example)
        if fmt.conversational:
            first = text_columns[0]
            try:
                prepared = prepare_multimodal_messages(example[first], images)
            except ValueError as error:
                raise DataError(f"Row {row} of {name}: {error}") from error
            for column in text_columns[1:]:
                if _image_blocks(example[column]):
                    raise DataError(
                        f"Row {row} of {name}: column {column!r} holds image blocks; images belong in "
                        f"{first!r} (the prompt or conversation)."
                    )
            count = _image_blocks(prepared)
        else:
            count = example[text_columns[0]].count(placeholder) if placeholder else len(images)
        if count != len(images):
            what = "{'type': 'image'} content blocks" if fmt.conversational else repr(placeholder)
            raise DataError(
                f"Row {row} of {name} has {len(images)} image(s) but {count} image placeholder(s) "
                f"({what}). Give one placeholder per image."
            )
        for image in images:
            open_image(image, row, verify=True)
    return fmt


def vision_inputs(batch: dict) -> dict:
    """The image inputs of a collated batch, for the model's forward."""
    return {k: batch[k] for k in VISION_INPUTS if k in batch}


# -- encoding --------------------------------------------------------------------------------------------
def image_token_ids(processor) -> set[int]:
    tokenizer = processor.tokenizer
    ids = {getattr(processor, "image_token_id", None)}
    for attribute in _IMAGE_TOKEN_ATTRIBUTES:
        for owner in (processor, tokenizer):
            token = getattr(owner, attribute, None)
            if isinstance(token, str):
                ids.add(tokenizer.convert_tokens_to_ids(token))
    ids.update(getattr(processor, "row_col_ids", None) or [])
    ids.discard(None)
    ids.discard(tokenizer.unk_token_id)
    return ids


def _carry_mask(plain_ids: list, plain_mask: list, expanded_ids: list) -> list[int]:
    """The mask of `plain_ids` carried over to `expanded_ids` (the same text with image tokens inserted);
    inserted tokens get 0."""
    if not any(plain_mask):
        return [0] * len(expanded_ids)
    mask, carried = [0] * len(expanded_ids), 0
    matcher = difflib.SequenceMatcher(a=plain_ids, b=expanded_ids, autojunk=False)
    for a, b, size in matcher.get_matching_blocks():
        mask[b : b + size] = plain_mask[a : a + size]
        carried += sum(plain_mask[a : a + size])
    if carried != sum(plain_mask):
        raise DataError(
            "The processor's token ids of a row differ from its tokenizer's beyond the image tokens, so "
            "its trained tokens cannot be located. Check that the processor's tokenizer is the one its "
            "chat template was written for."
        )
    return mask


@dataclass
class Segment:
    text: str
    spans: list | None | bool  # trained character spans; None = all of it, False = none


def encode_rows(
    processor,
    rows: list[list[Segment]],
    images: list[list],
    max_length: int | None,
    pad_to_multiple_of: int | None = None,
) -> tuple[dict, torch.Tensor]:
    """Each row's first segment (with the row's images) through the processor, the others through its tokenizer,
    concatenated, cut to `max_length` (keep_start) and right padded. Returns the model inputs and the
    trained-token mask [rows, T] (0 on image tokens, always)."""
    from posttrain.data.batches import pad

    tokenizer = processor.tokenizer
    loaded = [[open_image(image) for image in row] for row in images]
    out = processor(
        text=[row[0].text for row in rows],
        images=loaded if any(loaded) else None,
        padding=True,
        padding_side="right",
        add_special_tokens=False,
        return_tensors="pt",
    )
    image_ids = image_token_ids(processor)
    ids_rows, mask_rows, token_rows = [], [], {k: [] for k in TOKEN_INPUTS if k in out}
    for r, row in enumerate(rows):
        keep = out["attention_mask"][r].bool()
        ids = out["input_ids"][r][keep].tolist()
        first = row[0]
        plain_ids, plain_mask = tokenize_with_spans(
            tokenizer, first.text, None if first.spans is False else first.spans, add_special_tokens=False
        )
        if first.spans is False:
            plain_mask = [0] * len(plain_ids)
        mask = _carry_mask(plain_ids, plain_mask, ids)
        extra = {k: out[k][r][keep].tolist() for k in token_rows}
        for segment in row[1:]:
            seg_ids, seg_mask = tokenize_with_spans(
                tokenizer, segment.text, None if segment.spans is False else segment.spans, add_special_tokens=False
            )
            ids += seg_ids
            mask += [0] * len(seg_ids) if segment.spans is False else seg_mask
            for k in extra:
                extra[k] += [0] * len(seg_ids)
        mask = [0 if t in image_ids else m for t, m in zip(ids, mask)]
        if max_length is not None and len(ids) > max_length:
            if any(t in image_ids for t in ids[max_length:]):
                raise DataError(
                    f"max_length={max_length} cuts image tokens off a sequence of {len(ids)} tokens, "
                    "while its image stays: raise max_length or set it to None."
                )
            ids, mask = ids[:max_length], mask[:max_length]
            extra = {k: v[:max_length] for k, v in extra.items()}
        ids_rows.append(ids)
        mask_rows.append(mask)
        for k in extra:
            token_rows[k].append(extra[k])
    batch = {k: v for k, v in out.items() if k not in ("input_ids", "attention_mask", *TOKEN_INPUTS)}
    batch["input_ids"] = pad(ids_rows, tokenizer.pad_token_id, pad_to_multiple_of=pad_to_multiple_of)
    batch["attention_mask"] = pad([[1] * len(i) for i in ids_rows], 0, pad_to_multiple_of=pad_to_multiple_of)
    for k, values in token_rows.items():
        batch[k] = pad(values, 0, pad_to_multiple_of=pad_to_multiple_of)
    return batch, pad(mask_rows, 0, pad_to_multiple_of=pad_to_multiple_of)


class _Renderer:
    """A processor seen as the tokenizer `assistant_spans` renders with (the processor's chat template)."""

    def __init__(self, processor):
        self.processor, self.eos_token = processor, processor.tokenizer.eos_token

    def apply_chat_template(self, messages, **kwargs):
        return self.processor.apply_chat_template(messages, **kwargs)


def prompt_completion_texts(example: dict, processor, columns: tuple[str, ...]) -> tuple[str, list[str]]:
    """The rendered prompt and completion texts (TRL's `apply_chat_template` split) of a conversational row."""
    images = row_images(example)
    row = {"prompt": prepare_multimodal_messages(example["prompt"], images)}
    for column in columns:
        row[column] = prepare_multimodal_messages(example[column])
    rendered = apply_chat_template(row, processor)
    return rendered["prompt"], [rendered[c] for c in columns]


@dataclass
class VisionSFTCollator:
    """Rows of a vision SFT dataset (messages / text / prompt-completion + images) -> input_ids, attention_mask,
    labels and the processor's image inputs. Labels are -100 on padding, image tokens, the prompt (with
    `completion_only_loss`) and non-assistant turns (with `assistant_only_loss`)."""

    processor: object
    max_length: int | None = None
    completion_only_loss: bool = True
    assistant_only_loss: bool = False
    dataset_text_field: str = "text"
    pad_to_multiple_of: int | None = None

    def _segments(self, example: dict) -> list[Segment]:
        processor = self.processor
        if "messages" in example:
            messages = prepare_multimodal_messages(example["messages"], row_images(example))
            if self.assistant_only_loss:
                text, spans = assistant_spans(_Renderer(processor), messages)
                return [Segment(text, spans)]
            return [Segment(render(processor, messages), None)]
        if self.dataset_text_field in example:
            return [Segment(example[self.dataset_text_field], None)]
        if isinstance(example["prompt"], list):
            prompt, (completion,) = prompt_completion_texts(example, processor, ("completion",))
        else:
            prompt, completion = example["prompt"], example["completion"]
        return [Segment(prompt, False if self.completion_only_loss else None), Segment(completion, None)]

    def __call__(self, examples: list[dict]) -> dict:
        rows = [self._segments(e) for e in examples]
        batch, mask = encode_rows(
            self.processor, rows, [row_images(e) for e in examples], self.max_length, self.pad_to_multiple_of
        )
        batch["labels"] = batch["input_ids"].masked_fill(mask == 0, IGNORE_INDEX)
        return batch


@dataclass
class VisionPreferenceCollator:
    """B vision preference rows -> 2B sequences (prompt + chosen, then prompt + rejected), each with the row's
    images, as `PreferenceCollator` lays them out; `completion_mask` is 1 on completion tokens."""

    processor: object
    max_length: int | None = None
    pad_to_multiple_of: int | None = None

    def __call__(self, examples: list[dict]) -> dict:
        texts = []
        for e in examples:
            if isinstance(e["prompt"], list):
                texts.append(prompt_completion_texts(e, self.processor, ("chosen", "rejected")))
            else:
                texts.append((e["prompt"], [e["chosen"], e["rejected"]]))
        rows = [
            [Segment(prompt, False), Segment(completions[c], None)] for c in (0, 1) for prompt, completions in texts
        ]
        images = [row_images(e) for e in examples] * 2
        batch, mask = encode_rows(self.processor, rows, images, self.max_length, self.pad_to_multiple_of)
        batch["completion_mask"] = mask
        return batch


# -- per-row image inputs (for the online engine: one prompt's images travel with each of its completions) ----
def split_vision_inputs(batch: dict, images_per_row: list[int]) -> list[dict]:
    """The image inputs of a processed batch, cut into one dict per row. Three layouts exist: one entry per image
    along dim 0 (LLaVA, Gemma 3; `image_sizes` too), flattened patches with a per-image `image_grid_thw` (Qwen2-VL),
    and one entry per row padded to the most images (Idefics3: `pixel_values` [rows, images, C, H, W])."""
    inputs = {k: v for k, v in vision_inputs(batch).items() if k not in TOKEN_INPUTS}
    rows = [dict() for _ in images_per_row]
    if not inputs:
        return rows
    image_bounds = torch.tensor([0, *images_per_row]).cumsum(0).tolist()
    if "image_grid_thw" in inputs:
        patches = inputs["image_grid_thw"].prod(-1).tolist()
        patch_bounds = torch.tensor([0, *patches]).cumsum(0).tolist()
    for r in range(len(images_per_row)):
        first, last = image_bounds[r], image_bounds[r + 1]
        for key, value in inputs.items():
            if inputs["pixel_values"].dim() == 5:  # per row
                rows[r][key] = (
                    value[r : r + 1, : max(images_per_row[r], 1)] if key.startswith("pixel") else value[r : r + 1]
                )
            elif key == "pixel_values" and "image_grid_thw" in inputs:
                rows[r][key] = value[patch_bounds[first] : patch_bounds[last]]
            else:
                rows[r][key] = value[first:last]
    return rows


def merge_vision_inputs(rows: list[dict]) -> dict:
    """The inverse of `split_vision_inputs` for any selection or repetition of rows (e.g. one prompt's inputs once
    per completion): per-image entries are concatenated, per-row ones padded with zeros (Idefics3 skips all-zero
    images) to the most images."""
    keys = [k for k in VISION_INPUTS if any(k in row for row in rows)]
    out = {}
    per_row = any(row["pixel_values"].dim() == 5 for row in rows if "pixel_values" in row)
    for key in keys:
        values = [row[key] for row in rows if key in row]
        if values[0].dim() >= 4 and per_row:  # per row, padded to the most images
            most = max(v.shape[1] for v in values)
            values = [torch.cat([v, v.new_zeros((1, most - v.shape[1], *v.shape[2:]))], 1) for v in values]
        out[key] = torch.cat(values)
    return out


def vision_batch(parts: list[dict], prompt_width: int, completion_width: int = 0) -> dict:
    """The image inputs of a batch of sequences, one `parts` entry per sequence (its prompt's inputs from
    `split_vision_inputs`, with unpadded per-token inputs such as token_type_ids): the image entries merged, the
    per-token ones left-padded with 0 to `prompt_width` and extended with 0 over `completion_width` tokens."""
    out = merge_vision_inputs([{k: v for k, v in part.items() if k not in TOKEN_INPUTS} for part in parts])
    for key in TOKEN_INPUTS:
        if any(key in part for part in parts):
            rows = [part[key] for part in parts]
            out[key] = torch.stack(
                [torch.cat([v.new_zeros(prompt_width - len(v)), v, v.new_zeros(completion_width)]) for v in rows]
            )
    return out
