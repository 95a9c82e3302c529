"""GOLD's Universal Logit Distillation as a module (TRL's `ULDLoss`) and the teacher's re-tokenized inputs (TRL's
`build_teacher_inputs_from_texts`). The per-sequence loss is `posttrain.losses.gold.uld_sequence_parts`."""

from __future__ import annotations

import torch

from posttrain.data.byte_offsets import token_byte_offsets
from posttrain.losses.gold import shared_token_ids, uld_sequence_parts
from posttrain.losses.sft import IGNORE_INDEX, nll_sum

__all__ = ["ULDLoss", "build_teacher_inputs_from_texts"]


class ULDLoss(torch.nn.Module):
    """`ULDLoss(config, student_tokenizer=None, teacher_tokenizer=None)` reads GOLDConfig's `uld_*` settings,
    `use_extended_uld` and `beta`. Called on a batch it returns

        uld_crossentropy_weight * (student's next-token NLL, mean over labelled tokens)
        + uld_distillation_weight * (ULD, mean over rows).

    Hybrid ULD (`uld_use_hybrid_loss`) needs both tokenizers, whose shared tokens it compares directly; without
    them the plain sorted-probability ULD is used."""

    def __init__(self, config, student_tokenizer=None, teacher_tokenizer=None, device=None):
        super().__init__()
        self.config = config
        self.student_tokenizer, self.teacher_tokenizer = student_tokenizer, teacher_tokenizer
        self.shared_ids = None
        if getattr(config, "uld_use_hybrid_loss", False) and student_tokenizer and teacher_tokenizer:
            self.shared_ids = shared_token_ids(student_tokenizer.get_vocab(), teacher_tokenizer.get_vocab())
            if device is not None:
                self.shared_ids = tuple(ids.to(device) for ids in self.shared_ids)

    def row_parts(
        self,
        student_logits,
        teacher_logits,
        student_labels,
        teacher_labels,
        student_input_ids,
        teacher_input_ids,
        student_byte_offsets=None,
        teacher_byte_offsets=None,
    ) -> list[tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]]:
        """Per row, `(ULD, hybrid matched part, hybrid unmatched part)` (see `uld_sequence_parts`)."""
        config = self.config
        extended = config.use_extended_uld
        return [
            uld_sequence_parts(
                student_logits[i],
                teacher_logits[i],
                student_labels[i],
                teacher_labels[i],
                student_input_ids[i],
                teacher_input_ids[i],
                student_byte_offsets[i] if extended and student_byte_offsets is not None else None,
                teacher_byte_offsets[i] if extended and teacher_byte_offsets is not None else None,
                extended=extended,
                strategy=config.uld_token_merge_strategy,
                student_temperature=config.uld_student_temperature,
                teacher_temperature=config.uld_teacher_temperature,
                skip_student_eos=config.uld_skip_student_eos,
                skip_teacher_eos=config.uld_skip_teacher_eos,
                shared=self.shared_ids,
                beta=getattr(config, "beta", 1.0),
                matched_weight=getattr(config, "uld_hybrid_matched_weight", None),
                unmatched_weight=getattr(config, "uld_hybrid_unmatched_weight", None),
            )
            for i in range(len(student_labels))
        ]

    def forward(
        self,
        student_logits,
        teacher_logits,
        student_labels,
        teacher_labels,
        student_input_ids,
        teacher_input_ids,
        student_byte_offsets=None,
        teacher_byte_offsets=None,
    ) -> torch.Tensor:
        parts = self.row_parts(
            student_logits,
            teacher_logits,
            student_labels,
            teacher_labels,
            student_input_ids,
            teacher_input_ids,
            student_byte_offsets,
            teacher_byte_offsets,
        )
        loss = self.config.uld_distillation_weight * torch.stack([uld for uld, _, _ in parts]).mean()
        if self.config.uld_crossentropy_weight > 0:
            nll, _, count = nll_sum(student_logits, student_labels)
            loss = loss + self.config.uld_crossentropy_weight * nll / count.clamp(min=1)
        return loss


def build_teacher_inputs_from_texts(tokenizer, prompt_texts, completion_texts, use_extended_uld: bool = True):
    """The teacher's `(input_ids, labels, attention_mask, byte_offsets)`, right-padded: each prompt tokenized with
    the tokenizer's special tokens (a trailing EOS removed), its completion without, then the EOS appended (at byte
    offset len(completion)); only completion tokens are labelled; offsets relative to the completion (zeros
    without `use_extended_uld`, which does not read them). The attention mask is boolean, as TRL's."""
    rows = []
    for prompt, completion in zip(prompt_texts, completion_texts, strict=True):
        prompt_ids = tokenizer(prompt, add_special_tokens=True)["input_ids"]
        if prompt_ids and prompt_ids[-1] == tokenizer.eos_token_id:
            prompt_ids = prompt_ids[:-1]
        ids = tokenizer(completion, add_special_tokens=False)["input_ids"]
        offsets = token_byte_offsets(tokenizer, ids) if use_extended_uld else [(0, 0)] * len(ids)
        if tokenizer.eos_token_id is not None:
            end = len(completion.encode("utf-8")) if use_extended_uld else 0
            ids, offsets = ids + [tokenizer.eos_token_id], offsets + [(end, end)]
        rows.append((prompt_ids, ids, offsets))
    width = max(len(p) + len(c) for p, c, _ in rows)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    input_ids = torch.full((len(rows), width), pad, dtype=torch.long)
    labels = torch.full((len(rows), width), IGNORE_INDEX, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.bool)
    offsets = torch.zeros((len(rows), width, 2), dtype=torch.long)
    for i, (prompt_ids, ids, offs) in enumerate(rows):
        n, m = len(prompt_ids), len(prompt_ids) + len(ids)
        input_ids[i, :m] = torch.tensor(prompt_ids + ids)
        labels[i, n:m] = torch.tensor(ids)
        mask[i, :m] = True
        if offs:
            offsets[i, n:m] = torch.tensor(offs)
    return input_ids, labels, mask, offsets
