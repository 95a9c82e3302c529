"""The data side of self-distillation that SDFT and SDPO share (posttrain.experimental.sdft / .sdpo): prompt-only
training rows that point back to their raw row (`sd_row`), their collator, the sampler that repeats each prompt
for its completions, a generation backend that samples from the teacher's prompts instead, and the text helpers
that build the teacher's prompt.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.data import Sampler

from posttrain.data.collators import LanguageModelingCollator
from posttrain.data.formats import is_message_list
from posttrain.data.report import cut_column
from posttrain.errors import DataError
from posttrain.trainers.distillation import tokenize_prompt


@dataclass
class RowCollator(LanguageModelingCollator):
    """The language-modeling collator, keeping each row's index into the trainer's raw rows (`sd_row`)."""

    def __call__(self, examples: list[dict]) -> dict[str, torch.Tensor]:
        out = super().__call__(examples)
        if examples and "sd_row" in examples[0]:
            out["sd_row"] = torch.tensor([e["sd_row"] for e in examples], dtype=torch.long)
        return out


class RepeatedSampler(Sampler):
    """Each index of `base` `times` times in a row: a prompt's completions are consecutive rows (TRL's groups)."""

    def __init__(self, base: Sampler, times: int):
        self.base, self.times = base, times

    def __len__(self) -> int:
        return len(self.base) * self.times

    def __iter__(self):
        for index in self.base:
            yield from [index] * self.times

    def set_epoch(self, epoch: int) -> None:
        if hasattr(self.base, "set_epoch"):
            self.base.set_epoch(epoch)


class PromptSwapSampler:
    """A generation backend that samples from other prompts (the teacher's) in place of the ones it is given."""

    def __init__(self, backend, prompts: list[list[int]]):
        self.backend, self.prompts = backend, prompts

    def generate(self, prompt_ids, n, sampling, seed=None):
        return self.backend.generate(self.prompts, n, sampling, seed=seed)


def message_text(content: Any) -> str:
    """A message's text: the string, or the text parts of a multimodal content list joined by spaces."""
    if isinstance(content, list):
        return " ".join(part.get("text", "") for part in content if part.get("type") == "text")
    return str(content)


def with_user_text(prompt: Any, template: str, **values: Any) -> Any:
    """`template` filled with the prompt's text and `values`; for a conversation the last user message is replaced
    by the filled template (earlier messages kept)."""
    if not isinstance(prompt, list):
        return template.format(prompt=prompt, **values)
    if not prompt or prompt[-1].get("role") != "user":
        raise DataError(
            "Self-distillation builds the teacher's prompt from the last user message, but this prompt "
            f"ends with a {prompt[-1].get('role') if prompt else 'missing'!r} message. End prompts with "
            "a user turn."
        )
    text = template.format(prompt=message_text(prompt[-1].get("content", "")), **values)
    return list(prompt[:-1]) + [{"role": "user", "content": text}]


def privileged_text(context: Any) -> str:
    """A privileged_context as text: a string, the non-empty contents of a message list joined by newlines, or
    str() of anything else."""
    if context is None:
        raise DataError(  # TRL's words first
            "`privileged_context` must not be None: a row has none, and SDFT's teacher prompt needs one per row."
        )
    if isinstance(context, list) and context and isinstance(context[0], dict):
        return "\n".join(t for t in (message_text(m.get("content", "")) for m in context) if t)
    return context if isinstance(context, str) else str(context)


def prompt_ids(prompt, row: int, tokenizer, keep: int | None, template_kwargs: dict) -> list[int]:
    """A prompt's ids as TRL makes the student's (the chat template with the generation prompt for messages, the
    tokenizer's special tokens for text), cut to the last `keep` tokens."""
    ids = tokenize_prompt({"prompt": prompt}, row, tokenizer, is_message_list(prompt), template_kwargs)["input_ids"]
    return ids[-keep:] if keep else ids


def tokenize_prompt_row(
    example: dict, row: int, tokenizer, keep: int | None, template_kwargs: dict, offset: int
) -> dict:
    """A training row: the prompt's last `keep` ids, nothing trained (the student's sample is), and `sd_row`, the
    row's place among the trainer's raw rows (`offset` + `row`), where the teacher's inputs are built from."""
    full = prompt_ids(example["prompt"], row, tokenizer, None, template_kwargs)
    ids = full[-keep:] if keep else full
    return {
        "input_ids": ids,
        "completion_mask": [0] * len(ids),
        "sd_row": offset + row,
        cut_column("max_prompt_length"): len(full) - len(ids),
    }
