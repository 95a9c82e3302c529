"""Preference data (prompt, chosen, rejected): tokenization with truncation, and the collator that puts
chosen and rejected through the model in one forward. Shared by the reward and DPO trainers.

A tokenized row is three lists: ``prompt_ids``, ``chosen_ids``, ``rejected_ids``. The prompt is tokenized
on its own, as the model sees it at generation time, and each completion is the token continuation of it.
"""

from __future__ import annotations

import logging
import warnings
from dataclasses import dataclass

import torch

from posttrain.data.batches import pad
from posttrain.data.chat import extract_prompt, normalize_example, render, require_chat_template
from posttrain.data.formats import DatasetFormat, check_example, is_message_list, validate_dataset
from posttrain.data.report import DatasetReport, cut_column
from posttrain.data.tokenize import row_template_kwargs
from posttrain.errors import DataError

logger = logging.getLogger("posttrain")

COMPLETIONS = ("chosen", "rejected")
# Per-row numbers that travel with a row to the batch as float tensors.
FLOAT_COLUMNS = ("ref_chosen_logps", "ref_rejected_logps", "margin")


def _text_ids(tokenizer, text: str, add_special_tokens: bool) -> list[int]:
    return tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"]


def _conversational_ids(example: dict, tokenizer, row: int) -> tuple[list[int], dict[str, list[int]]]:
    """Prompt rendered with the generation prompt; each completion is the whole rendered continuation: the
    end-of-turn token and whatever the template puts after it (ChatML's newline), as TRL trains it."""
    require_chat_template(tokenizer)
    prompt = list(example["prompt"])
    kwargs = row_template_kwargs(example, row)  # the row's own chat_template_kwargs and tools, as TRL reads them
    continue_final = prompt[-1]["role"] == "assistant"  # an assistant-ended prompt is continued, not answered
    prompt_text = render(
        tokenizer, prompt, add_generation_prompt=not continue_final, continue_final_message=continue_final, **kwargs
    )
    completions = {}
    for column in COMPLETIONS:
        full = render(tokenizer, prompt + list(example[column]), **kwargs)
        if not full.startswith(prompt_text):
            raise DataError(
                f"Row {row}: the rendered prompt is not a prefix of the rendered prompt + {column}, so the "
                f"{column} completion cannot be told apart. Check the chat template (it must render earlier turns "
                "the same way whatever follows them)."
            )
        completions[column] = _text_ids(tokenizer, full[len(prompt_text) :], add_special_tokens=False)
    # The template carries any BOS itself.
    return _text_ids(tokenizer, prompt_text, add_special_tokens=False), completions


def _standard_ids(example: dict, tokenizer) -> tuple[list[int], dict[str, list[int]]]:
    """Prompt text (with the tokenizer's special tokens, e.g. BOS) then completion text plus EOS."""
    eos = tokenizer.eos_token_id
    completions = {}
    for column in COMPLETIONS:
        ids = _text_ids(tokenizer, example[column], add_special_tokens=False)
        if eos is not None and (not ids or ids[-1] != eos):
            ids = ids + [eos]
        completions[column] = ids
    return _text_ids(tokenizer, example["prompt"], add_special_tokens=True), completions


def tokenize_preference(
    example: dict,
    tokenizer,
    fmt: DatasetFormat,
    *,
    row: int,
    max_prompt_length: int | None = None,
    max_completion_length: int | None = None,
) -> dict[str, list[int]]:
    """`prompt_ids`, `chosen_ids`, `rejected_ids` for one standard or conversational preference row.

    The optional per-part limits keep the end of the prompt (the part next to the answer) and the start of
    each completion. The bound on the whole sequence (`max_length`) is applied by `PreferenceCollator`.
    """
    if not fmt.has_explicit_prompt:
        example = extract_prompt(example)
    if fmt.conversational:
        prompt_ids, completions = _conversational_ids(normalize_example(example), tokenizer, row)
    else:
        prompt_ids, completions = _standard_ids(example, tokenizer)
    for column, ids in completions.items():
        if not ids:
            raise DataError(f"Row {row}: the '{column}' completion has no tokens. Fix or drop the row.")
    out = {"prompt_ids": prompt_ids, **{f"{c}_ids": ids for c, ids in completions.items()}}
    return _apply_limits(out, max_prompt_length, max_completion_length)


def _apply_limits(out: dict, max_prompt_length: int | None, max_completion_length: int | None) -> dict:
    """Keeps the end of the prompt and the start of each completion."""
    if max_prompt_length is not None and len(out["prompt_ids"]) > max_prompt_length:
        out["prompt_ids"] = out["prompt_ids"][len(out["prompt_ids"]) - max_prompt_length :]
    if max_completion_length is not None:
        for column in COMPLETIONS:
            out[f"{column}_ids"] = out[f"{column}_ids"][:max_completion_length]
    return out


def _tokenize_row(example, row, tokenizer, fmt, limits):
    """A tokenized row, with the tokens each per-part limit removed in report columns."""
    check_example(example, fmt, row)
    full = tokenize_preference(example, tokenizer, fmt, row=row)
    sizes = {k: len(v) for k, v in full.items()}
    out = _apply_limits(full, **limits)
    out[cut_column("max_prompt_length")] = sizes["prompt_ids"] - len(out["prompt_ids"])
    out[cut_column("max_completion_length")] = sum(sizes[f"{c}_ids"] - len(out[f"{c}_ids"]) for c in COMPLETIONS)
    return out


def warn_identical_pairs(dataset, name: str = "train_dataset") -> list[int]:
    """Logs one warning for rows whose chosen and rejected tokens are the same; returns those rows.

    Such a pair has zero preference signal (its DPO logit is 0 whatever the model does).
    """
    same = [i for i, (c, r) in enumerate(zip(dataset["chosen_ids"], dataset["rejected_ids"])) if c == r]
    if same:
        shown = ", ".join(map(str, same[:10])) + (", ..." if len(same) > 10 else "")
        logger.warning(
            "%d row(s) of %s have identical chosen and rejected completions after tokenization (rows %s): they "
            "carry no preference signal. Fix or drop them.",
            len(same),
            name,
            shown,
        )
    return same


TRUNCATION_MODES = ("keep_start", "keep_end")


def drop_overlong_rows(dataset, max_length: int | None, mode: str, name: str, report: DatasetReport | None = None):
    """Drops the rows that `max_length` leaves without a comparison, with a warning naming how many.

    mode 'keep_start' (DPO: the collator cuts each sequence's end) drops rows whose prompt alone fills max_length;
    'keep_end' (the collator keeps each sequence's end) drops nothing; 'drop' (reward modelling, as TRL does) drops
    rows where prompt + chosen or prompt + rejected is longer than max_length.
    """
    if max_length is None or mode == "keep_end" or not len(dataset):
        return dataset
    if mode == "keep_start":
        keep = [len(p) < max_length for p in dataset["prompt_ids"]]
        why = f"their prompt alone fills max_length={max_length}, leaving no completion token"
    else:
        keep = [
            len(p) + max(len(c), len(r)) <= max_length
            for p, c, r in zip(dataset["prompt_ids"], dataset["chosen_ids"], dataset["rejected_ids"])
        ]
        why = f"prompt + chosen or prompt + rejected is longer than max_length={max_length}"
    dropped = len(keep) - sum(keep)
    if dropped == len(keep):
        raise DataError(f"Every row of {name} is dropped because {why}. Raise max_length (or set it to None).")
    if dropped:
        logger.warning(
            "Dropping %d of %d rows of %s: %s. Raise max_length to keep them.", dropped, len(keep), name, why
        )
        if report is not None:
            report.dropped(dropped, why)
        dataset = dataset.select([i for i, k in enumerate(keep) if k])
    return dataset


# Pre-tokenized whole sequences of a reward dataset: TRL's names, and the older ones it still reads (with a warning).
TOKENIZED_PAIR_COLUMNS = ("chosen_ids", "rejected_ids")
OLD_TOKENIZED_PAIR_COLUMNS = ("chosen_input_ids", "rejected_input_ids")


def _split_tokenized_pair(example: dict) -> dict:
    chosen, rejected = list(example["chosen_ids"]), list(example["rejected_ids"])
    shared = 0
    while shared < min(len(chosen), len(rejected)) - 1 and chosen[shared] == rejected[shared]:
        shared += 1  # at least one token of each stays a completion
    return {"prompt_ids": chosen[:shared], "chosen_ids": chosen[shared:], "rejected_ids": rejected[shared:]}


def tokenized_pairs_as_prompt_and_completions(dataset, name: str = "train_dataset"):
    """A reward dataset of whole tokenized sequences (`chosen_ids` / `rejected_ids`; the older `chosen_input_ids` /
    `rejected_input_ids` are renamed, with a FutureWarning) as prompt_ids + chosen_ids + rejected_ids: their shared
    first tokens become the prompt, computed once. Other datasets are returned unchanged."""
    columns = dataset.column_names
    if all(c in columns for c in OLD_TOKENIZED_PAIR_COLUMNS) and not any(c in columns for c in TOKENIZED_PAIR_COLUMNS):
        warnings.warn(
            f"{name}'s columns 'chosen_input_ids' / 'rejected_input_ids' are read as 'chosen_ids' / 'rejected_ids'; "
            "the old names will not be supported in v1 of TRL's API. Rename them.",
            FutureWarning,
            stacklevel=3,
        )
        dataset = dataset.rename_columns(dict(zip(OLD_TOKENIZED_PAIR_COLUMNS, TOKENIZED_PAIR_COLUMNS)))
        columns = dataset.column_names
    if not all(c in columns for c in TOKENIZED_PAIR_COLUMNS) or "prompt_ids" in columns or "chosen" in columns:
        return dataset
    keep = [c for c in columns if c in FLOAT_COLUMNS]
    return dataset.map(_split_tokenized_pair, remove_columns=[c for c in columns if c not in keep])


def prepare_preference_dataset(
    dataset,
    tokenizer,
    *,
    trainer: str,
    name: str = "train_dataset",
    max_prompt_length: int | None = None,
    max_completion_length: int | None = None,
    max_length: int | None = None,
    truncation_mode: str = "keep_start",
    num_proc: int | None = None,
    report: DatasetReport | None = None,
):
    """Validates a preference dataset and tokenizes every row (checking each); keeps the FLOAT_COLUMNS; drops the
    rows `max_length` leaves without a comparison (see `drop_overlong_rows`; `truncation_mode` 'drop' is the
    reward trainer's rule). `trainer` names the caller in error messages. `report` receives what was cut or dropped,
    including the sequences the collator will cut to `max_length`.
    """
    report = report if report is not None else DatasetReport(rows_in=len(dataset))
    first = dataset[0] if len(dataset) else {}
    if any(is_message_list(v) and any("from" in m for m in v) for v in first.values()):
        dataset = dataset.map(normalize_example, desc="Converting ShareGPT rows")
    fmt = validate_dataset(dataset, ("preference",), trainer, name)
    if fmt.conversational:
        require_chat_template(tokenizer)
    limits = dict(max_prompt_length=max_prompt_length, max_completion_length=max_completion_length)
    dataset = dataset.map(
        _tokenize_row,
        with_indices=True,
        num_proc=num_proc,
        remove_columns=[c for c in dataset.column_names if c not in FLOAT_COLUMNS],
        fn_kwargs=dict(tokenizer=tokenizer, fmt=fmt, limits=limits),
        desc=f"Tokenizing {name}",
    )
    dataset = report.take_cuts(drop_overlong_rows(dataset, max_length, truncation_mode, name, report))
    if truncation_mode != "drop" and max_length is not None and len(dataset):
        over = [
            max(len(p) + len(c) - max_length, 0) + max(len(p) + len(r) - max_length, 0)
            for p, c, r in zip(dataset["prompt_ids"], dataset["chosen_ids"], dataset["rejected_ids"])
        ]
        kept = "start" if truncation_mode == "keep_start" else "end"
        report.truncated(
            sum(n > 0 for n in over),
            sum(over),
            f"prompt + chosen/rejected longer than max_length (the collator keeps each sequence's {kept})",
        )
    warn_identical_pairs(dataset, name)
    return dataset


@dataclass
class PreferenceCollator:
    """Batches tokenized preference pairs for DPO-style trainers: chosen and rejected sequences in one batch.

    B preference rows -> 2B sequences: prompt+chosen (rows 0..B-1), then prompt+rejected (rows B..2B-1).

    Each sequence longer than `max_length` is cut: 'keep_start' keeps its first max_length tokens (the end of the
    completion goes), 'keep_end' its last ones (the start of the prompt goes). `completion_mask` is 1 on
    completion tokens, except on a sequence's first token (which nothing predicts; it matters only for an empty
    or cut-away prompt). Padded batches are right padded, to a multiple of `pad_to_multiple_of` if set, with an
    `attention_mask`; padding-free batches are one row with `position_ids` restarting at 0 for each sequence.

    See docs/trainers/dpo.md.
    """

    pad_token_id: int
    padding_free: bool = False
    max_length: int | None = None
    truncation_mode: str = "keep_start"
    pad_to_multiple_of: int | None = None

    def __post_init__(self):
        if self.truncation_mode not in TRUNCATION_MODES:
            raise ValueError(f"truncation_mode={self.truncation_mode!r}; choose from {list(TRUNCATION_MODES)}.")

    def _cut(self, ids: list) -> list:
        if self.max_length is None or len(ids) <= self.max_length:
            return ids
        return ids[: self.max_length] if self.truncation_mode == "keep_start" else ids[len(ids) - self.max_length :]

    def __call__(self, examples: list[dict]) -> dict[str, torch.Tensor]:
        sequences, masks = [], []
        for column in ("chosen_ids", "rejected_ids"):
            for e in examples:
                sequences.append(self._cut(list(e["prompt_ids"]) + list(e[column])))
                mask = self._cut([0] * len(e["prompt_ids"]) + [1] * len(e[column]))
                mask[0] = 0
                masks.append(mask)
        if self.padding_free:
            batch = {
                "input_ids": torch.tensor([sum(sequences, [])], dtype=torch.long),
                "position_ids": torch.tensor([[p for s in sequences for p in range(len(s))]], dtype=torch.long),
                "completion_mask": torch.tensor([sum(masks, [])], dtype=torch.long),
                "use_cache": False,
            }
        else:
            multiple = self.pad_to_multiple_of
            batch = {
                "input_ids": pad(sequences, self.pad_token_id, pad_to_multiple_of=multiple),
                "attention_mask": pad([[1] * len(s) for s in sequences], 0, pad_to_multiple_of=multiple),
                "completion_mask": pad(masks, 0, pad_to_multiple_of=multiple),
            }
        for column in FLOAT_COLUMNS:
            if column in examples[0]:
                batch[column] = torch.tensor([float(e[column]) for e in examples], dtype=torch.float32)
        return batch
