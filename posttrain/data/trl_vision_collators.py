"""TRL's vision collators by their names and fields, over posttrain's vision batching (data/vision.py): rows with
images are tokenized and their images processed on the fly, per batch.

- `DataCollatorForVisionLanguageModeling` (SFT): input_ids, attention_mask, labels and the image inputs. As in
  TRL, with `completion_only_loss=False` (its default) the labels are every real token, image tokens included.
- `DataCollatorForVisionPreference` (DPO): B rows -> 2B sequences (prompt + chosen, then prompt + rejected) and a
  `completion_mask`.
- `DataCollatorForVisionUnpairedPreference` (KTO): prompt + completion, `completion_mask`, `label`, and with
  `calculate_kl` the mismatched pairs of KTO's KL estimate (row i's prompt with row i-1's completion) as `KL_*`.
- `DataCollatorForVisionLanguageChatML` (`trl.experimental.utils`, TRL's GOLD on images): prompt + completion with
  the prompt's tokens unlabelled, the prompts alone (left-padded) for sampling, each completion token's byte span
  and the rows' raw texts (for a teacher with another tokenizer). Prompts and completions are processed as TRL's
  (left- and right-padded apart, then flushed left), so its batches are TRL's exactly.

Padding is on the right; padded positions hold the tokenizer's pad id (TRL's hold its EOS id where the pad id is 0;
the attention mask is 0 there either way)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from posttrain.data.batches import flush_left
from posttrain.data.chat import apply_chat_template
from posttrain.data.formats import is_conversational
from posttrain.data.sequence_tensors import piece_byte_len
from posttrain.data.transforms import prepare_multimodal_messages
from posttrain.data.vision import (
    Segment,
    VisionPreferenceCollator,
    VisionSFTCollator,
    encode_rows,
    prompt_completion_texts,
    row_images,
)

IGNORE_INDEX = -100


@dataclass
class DataCollatorForVisionLanguageModeling(VisionSFTCollator):
    """`DataCollatorForVisionLanguageModeling(processor, max_length=None, completion_only_loss=False, ...)`."""

    completion_only_loss: bool = False
    chat_template: str | None = None
    return_tensors: str = "pt"

    def __call__(self, examples: list[dict]) -> dict:
        _check_tensors(self.return_tensors)
        batch = super().__call__(examples)
        if not self.completion_only_loss and not self.assistant_only_loss:
            batch["labels"] = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, IGNORE_INDEX)
        return batch


@dataclass
class DataCollatorForVisionPreference(VisionPreferenceCollator):
    """`DataCollatorForVisionPreference(processor, max_length=None, pad_to_multiple_of=None)`."""

    return_tensors: str = "pt"

    def __call__(self, examples: list[dict]) -> dict:
        _check_tensors(self.return_tensors)
        return super().__call__(examples)


@dataclass
class DataCollatorForVisionUnpairedPreference:
    """`DataCollatorForVisionUnpairedPreference(processor, max_length=None, calculate_kl=True, ...)`: rows with
    `prompt`, `completion`, `label` and images."""

    processor: object
    max_length: int | None = None
    calculate_kl: bool = True
    pad_to_multiple_of: int | None = None
    return_tensors: str = "pt"

    def _texts(self, example: dict) -> tuple[str, str]:
        if isinstance(example["prompt"], list):
            prompt, (completion,) = prompt_completion_texts(example, self.processor, ("completion",))
            return prompt, completion
        return example["prompt"], example["completion"]

    def _encode(self, pairs: list[tuple[str, str]], images: list[list]) -> dict:
        rows = [[Segment(prompt, False), Segment(completion, None)] for prompt, completion in pairs]
        batch, mask = encode_rows(self.processor, rows, images, self.max_length, self.pad_to_multiple_of)
        batch["completion_mask"] = mask
        return batch

    def __call__(self, examples: list[dict]) -> dict:
        _check_tensors(self.return_tensors)
        texts = [self._texts(e) for e in examples]
        images = [row_images(e) for e in examples]
        batch = self._encode(texts, images)
        if self.calculate_kl:
            shifted = [(prompt, texts[i - 1][1]) for i, (prompt, _) in enumerate(texts)]
            kl = self._encode(shifted, images)
            for key in ("input_ids", "attention_mask", "completion_mask", "token_type_ids", "mm_token_type_ids"):
                if key in kl:
                    batch[f"KL_{key}"] = kl[key]
        batch["label"] = torch.tensor([bool(e["label"]) for e in examples])
        return batch


def _raw_text(value) -> str:
    """A prompt's or completion's text: a string as it is, messages as their text parts joined by newlines."""
    if isinstance(value, str):
        return value
    turns = []
    for message in value:
        content = message.get("content", "")
        parts = (
            [content]
            if isinstance(content, str)
            else [
                block if isinstance(block, str) else block.get("text", "")
                for block in content
                if isinstance(block, str) or (isinstance(block, dict) and block.get("type") == "text")
            ]
        )
        text = "\n".join(part for part in parts if part)
        if text:
            turns.append(text)
    return "\n".join(turns)


def _byte_offsets(tokenizer, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Each labelled token's byte span within its row's completion ((0, 0) elsewhere)."""
    lengths: dict[int, int] = {}
    rows = []
    for ids, row_labels in zip(input_ids.tolist(), labels.tolist()):
        spans, end = [], 0
        for token, label in zip(ids, row_labels):
            if label == IGNORE_INDEX:
                spans.append((0, 0))
                continue
            if token not in lengths:
                lengths[token] = piece_byte_len(tokenizer.convert_ids_to_tokens([token])[0])
            spans.append((end, end + lengths[token]))
            end += lengths[token]
        rows.append(spans)
    return torch.tensor(rows, dtype=torch.long).reshape(len(rows), input_ids.shape[1], 2)


@dataclass
class DataCollatorForVisionLanguageChatML:
    """`DataCollatorForVisionLanguageChatML(processor, max_length=None)`: rows with `prompt`, `completion` (text or
    messages) and `images` / `image`."""

    processor: object
    max_length: int | None = None
    return_tensors: str = "pt"

    def _texts(self, examples: list[dict]) -> tuple[list[str], list[str], list | None]:
        images = [row_images(e) for e in examples]
        if is_conversational(examples[0]):
            rendered = [
                apply_chat_template(
                    {
                        "prompt": prepare_multimodal_messages(e["prompt"], images=row),
                        "completion": prepare_multimodal_messages(e["completion"]),
                    },
                    self.processor,
                )
                for e, row in zip(examples, images)
            ]
            examples = rendered
        prompts, completions = [e["prompt"] for e in examples], [e["completion"] for e in examples]
        return prompts, completions, None if all(not row for row in images) else images

    def __call__(self, examples: list[dict]) -> dict:
        _check_tensors(self.return_tensors)
        if "prompt" not in examples[0] or "completion" not in examples[0]:
            raise KeyError(
                "DataCollatorForVisionLanguageChatML needs 'prompt' and 'completion' in each row; got "
                f"{sorted(examples[0])}."
            )
        raw = [(_raw_text(e["prompt"]), _raw_text(e["completion"])) for e in examples]
        prompts, completions, images = self._texts(examples)
        common = dict(padding=True, return_tensors="pt", add_special_tokens=False)
        prompt = self.processor(images=images, text=prompts, padding_side="left", **common)
        completion = self.processor(text=completions, padding_side="right", **common)
        extra = [k for k in ("token_type_ids", "mm_token_type_ids") if k in prompt]
        joined = [torch.cat((prompt["attention_mask"], completion["attention_mask"]), 1)]
        joined += [torch.cat((prompt["input_ids"], completion["input_ids"]), 1)]
        joined += [torch.cat((torch.zeros_like(prompt["attention_mask"]), completion["attention_mask"]), 1)]
        joined += [
            torch.cat((prompt[k], completion.get(k, torch.zeros_like(completion["input_ids"]))), 1) for k in extra
        ]
        mask, ids, completion_mask, *types = (t[:, : self.max_length] for t in flush_left(*joined))
        labels = ids.masked_fill((mask == 0) | (completion_mask == 0), IGNORE_INDEX)
        batch = {k: v for k, v in prompt.items() if k not in ("input_ids", "attention_mask", *extra)}
        batch.update(input_ids=ids, attention_mask=mask, labels=labels, **dict(zip(extra, types)))
        batch["byte_offsets"] = _byte_offsets(self.processor.tokenizer, ids, labels)
        batch["prompts"] = prompt["input_ids"][:, : self.max_length]
        batch["prompt_attention_mask"] = prompt["attention_mask"][:, : self.max_length]
        batch["original_prompt_text"], batch["original_completion_text"] = map(list, zip(*raw))
        return batch


def _check_tensors(return_tensors: str) -> None:
    if return_tensors != "pt":
        raise ValueError(f"return_tensors={return_tensors!r}: only 'pt' (PyTorch tensors) is supported.")


__all__ = [
    "DataCollatorForVisionLanguageChatML",
    "DataCollatorForVisionLanguageModeling",
    "DataCollatorForVisionPreference",
    "DataCollatorForVisionUnpairedPreference",
]
