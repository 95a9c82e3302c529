"""SFT's data: text, conversations, prompt-completion pairs or pre-tokenized rows turned into the rows the
language-modeling collator takes (`input_ids` and `labels`, -100 on untrained tokens, as TRL prepares them), cut to
max_length, packed and
shuffled as the SFT config says (`prepare_sft_dataset`). The trainers built on SFT (distillation, GKD) share it.
"""

from __future__ import annotations

import warnings

from posttrain.data.chat import normalize_example, require_chat_template
from posttrain.data.collators import IGNORE_INDEX
from posttrain.data.formats import DatasetFormat, check_example, is_message_list, validate_dataset
from posttrain.data.packing import pack_dataset
from posttrain.data.report import DataReport, cut_column, note_packing
from posttrain.data.tokenize import tokenize_example, truncate
from posttrain.data.tokenizer_setup import check_eos_for_training
from posttrain.errors import ConfigError, DataError


def prepare_sft_dataset(dataset, tokenizer, args, name: str, data_report: DataReport, formatting_func=None):
    """`dataset` (not a vision one) as rows for the collator; `args` is an SFTConfig, `data_report` the trainer's
    data report, `formatting_func` turns each example into its text."""
    packing = args.packing if name == "train_dataset" or args.eval_packing is None else args.eval_packing
    if getattr(dataset, "format", {}).get("type") == "custom":
        raise ConfigError(
            f"{name} has a transform (Dataset.with_transform()), which tokenizing through map() "
            "would bake in. Apply deterministic transforms with map() first, or pass "
            "dataset_kwargs={'skip_prepare_dataset': True} with trainer-ready rows (tokenized for the collator)."
        )
    max_length = None if packing else args.max_length  # packing cuts to max_length itself
    report = data_report.start(name, len(dataset))
    if "input_ids" in dataset.column_names:
        dataset = _prepare_tokenized(dataset, args, max_length, name, formatting_func)
    else:
        dataset = _tokenize(dataset, tokenizer, args, max_length, name, formatting_func)
    dataset = report.take_cuts(dataset)
    if packing:
        if args.shuffle_dataset:  # else neighbours in the data would share rows
            dataset = dataset.shuffle(seed=args.seed)
        split = args.packing_split_long or args.packing_strategy == "bfd_split"
        strategy = "wrapped" if args.packing_strategy == "wrapped" else "bfd"
        note_packing(report, dataset, args.max_length, strategy, split)
        dataset = pack_dataset(dataset, args.max_length, strategy, split, num_proc=args.dataset_num_proc)
    if args.shuffle_dataset:
        dataset = dataset.shuffle(seed=args.seed)
    return dataset


def _tokenize(dataset, tokenizer, args, max_length, name: str, formatting_func):
    """Text (after formatting_func or from dataset_text_field), conversations or prompt-completion rows, tokenized
    with their completion masks and cut to max_length."""
    columns = dataset.column_names
    if formatting_func is not None:
        dataset = dataset.map(
            _format_row,
            with_indices=True,
            remove_columns=columns,
            fn_kwargs={"formatting_func": formatting_func},
            num_proc=args.dataset_num_proc,
            desc=f"Formatting {name}",
        )
    elif args.dataset_text_field != "text":
        text_field = args.dataset_text_field
        if text_field in columns:
            dataset = dataset.remove_columns([c for c in ("text",) if c in columns]).rename_column(text_field, "text")
        elif not any(c in columns for c in ("messages", "prompt", "completion", "text")):
            raise ConfigError(
                f"dataset_text_field={text_field!r} is not a column of {name} (columns: "
                f"{columns}). Set dataset_text_field to the column that holds the text."
            )
    first = dataset[0] if len(dataset) else {}
    if "messages" not in first and is_message_list(first.get("conversations")):  # ShareGPT's column name, as TRL
        dataset = dataset.rename_column("conversations", "messages")
        first = dataset[0]
    if any(is_message_list(v) and any("from" in m for m in v) for v in first.values()):
        dataset = dataset.map(normalize_example, desc="Converting ShareGPT rows")
    fmt: DatasetFormat = validate_dataset(dataset, ("language_modeling", "prompt_completion"), "SFTTrainer", name)
    if args.assistant_only_loss and not fmt.conversational:
        raise ConfigError(
            "assistant_only_loss=True needs conversational data (lists of {'role', 'content'} messages), but "
            f"{name} is in standard (string) form. Set assistant_only_loss=False, or for prompt-completion "
            "strings rely on completion_only_loss."
        )
    if fmt.conversational:
        require_chat_template(tokenizer)
    check_eos_for_training(tokenizer, fmt, args.add_eos)
    return dataset.map(
        _tokenize_row,
        with_indices=True,
        remove_columns=dataset.column_names,
        num_proc=args.dataset_num_proc,
        fn_kwargs=dict(
            tokenizer=tokenizer,
            fmt=fmt,
            max_length=max_length,
            completion_only_loss=args.completion_only_loss is not False,
            assistant_only_loss=args.assistant_only_loss,
            add_eos=args.add_eos,
            truncation_mode=args.truncation_mode,
        ),
        desc=f"Tokenizing {name}",
    )


def _prepare_tokenized(dataset, args, max_length, name: str, formatting_func):
    """Rows that already hold input_ids: labels from their masks (as TRL: `completion_mask` only counts with
    completion-only loss, which defaults to off without prompt/completion columns), truncated."""
    columns = dataset.column_names
    if formatting_func is not None:
        warnings.warn(
            f"{name} is already tokenized (it has input_ids): formatting_func is not applied to it.", stacklevel=4
        )
    if "seq_lengths" in columns:  # packed already
        return dataset
    return dataset.map(
        _labels_row,
        with_indices=True,
        num_proc=args.dataset_num_proc,
        remove_columns=[c for c in columns if c not in ("input_ids", "labels")],
        fn_kwargs=dict(
            use_completion_mask=completion_only(args, dataset),
            max_length=max_length,
            truncation_mode=args.truncation_mode,
        ),
        desc=f"Building labels for {name}",
    )


def _tokenize_row(
    example, row, tokenizer, fmt, max_length, completion_only_loss, assistant_only_loss, add_eos, truncation_mode
):
    check_example(example, fmt, row)
    out = tokenize_example(
        example,
        tokenizer,
        fmt,
        row=row,
        completion_only_loss=completion_only_loss,
        assistant_only_loss=assistant_only_loss,
        add_eos=add_eos,
        truncation_mode=truncation_mode,
    )
    ids, mask = truncate(out["input_ids"], out["completion_mask"], max_length, truncation_mode, row)
    labels = [t if m else IGNORE_INDEX for t, m in zip(ids, mask)]  # TRL's prepared layout: input_ids + labels
    return {"input_ids": ids, "labels": labels, cut_column("max_length"): len(out["input_ids"]) - len(ids)}


def _format_row(example, row, formatting_func):
    text = formatting_func(example)
    if not isinstance(text, str):
        raise DataError(
            f"Row {row}: formatting_func returned {type(text).__name__}, not a string. It is called on "
            "one example at a time and must return that example's text."
        )
    return {"text": text}


def _labels_row(example, row, use_completion_mask, max_length, truncation_mode):
    """Labels of a pre-tokenized row: its own `labels`, else input ids masked by `assistant_masks` (and
    `completion_mask` with completion-only loss); truncated."""
    ids = example["input_ids"]
    labels = example.get("labels")
    if labels is None:
        masks = [
            example[c]
            for c in ("completion_mask", "assistant_masks")
            if example.get(c) is not None and (c != "completion_mask" or use_completion_mask)
        ]
        labels = [t if all(bits) else IGNORE_INDEX for t, *bits in zip(ids, *masks)]
    n = len(ids)
    ids, labels = truncate(list(ids), list(labels), max_length, truncation_mode, row, untrained=IGNORE_INDEX)
    return {"input_ids": ids, "labels": labels, cut_column("max_length"): n - len(ids)}


def completion_only(args, dataset) -> bool:
    """Whether completion-only loss applies: as set, else on for data with prompt and completion columns."""
    if args.completion_only_loss is not None:
        return args.completion_only_loss
    columns = getattr(dataset, "column_names", None) or []
    return "prompt" in columns and "completion" in columns
