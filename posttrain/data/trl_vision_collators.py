"""TRL's vision collators by their names and fields, over posttrain's vision batching (data/vision.py): rows with
images are tokenized and their images processed on the fly, per batch.

- `DataCollatorForVisionLanguageModeling` (SFT): input_ids, attention_mask, labels and the image inputs. As in
  TRL, with `completion_only_loss=False` (its default) the labels are every real token, image tokens included.
- `DataCollatorForVisionPreference` (DPO): B rows -> 2B sequences (prompt + chosen, then prompt + rejected) and a
  `completion_mask`.
- `DataCollatorForVisionUnpairedPreference` (KTO): prompt + completion, `completion_mask`, `label`, and with
  `calculate_kl` the mismatched pairs of KTO's KL estimate (row i's prompt with row i-1's completion) as `KL_*`.

Padding is on the right; padded positions hold the tokenizer's pad id (TRL's hold its EOS id where the pad id is 0;
the attention mask is 0 there either way)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

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


def _check_tensors(return_tensors: str) -> None:
    if return_tensors != "pt":
        raise ValueError(f"return_tensors={return_tensors!r}: only 'pt' (PyTorch tensors) is supported.")


__all__ = [
    "DataCollatorForVisionLanguageModeling",
    "DataCollatorForVisionPreference",
    "DataCollatorForVisionUnpairedPreference",
]
