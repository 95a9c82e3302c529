"""Preference tokenization (formats, implicit prompts, truncation) and the collator, element by element."""

import logging

import pytest
import torch
from datasets import Dataset

from posttrain.data.formats import detect_format
from posttrain.data.preference import PreferenceCollator, prepare_preference_dataset, tokenize_preference
from posttrain.errors import DataError


def _ids(tokenizer, text, special=False):
    return tokenizer(text, add_special_tokens=special)["input_ids"]


def _tok(example, tokenizer, **kw):
    return tokenize_preference(example, tokenizer, detect_format(example.keys(), example), row=0, **kw)


def _chat(role, content):
    return [{"role": role, "content": content}]


def test_conversational_row_prompt_has_generation_prompt_completion_ends_with_end_of_turn(tokenizer):
    row = {
        "prompt": _chat("user", "say red"),
        "chosen": _chat("assistant", "red"),
        "rejected": _chat("assistant", "blue"),
    }
    out = _tok(row, tokenizer)
    assert out["prompt_ids"] == _ids(tokenizer, "<|im_start|>user\nsay red<|im_end|>\n<|im_start|>assistant\n")
    # As in TRL, the template's newline after <|im_end|> belongs to the completion.
    assert out["chosen_ids"] == _ids(tokenizer, "red<|im_end|>\n")
    assert out["rejected_ids"] == _ids(tokenizer, "blue<|im_end|>\n")
    assert out["chosen_ids"][-2] == tokenizer.eos_token_id


def test_conversational_implicit_prompt_is_extracted(tokenizer):
    user = _chat("user", "say red")
    implicit = {"chosen": user + _chat("assistant", "red"), "rejected": user + _chat("assistant", "blue")}
    explicit = {"prompt": user, "chosen": _chat("assistant", "red"), "rejected": _chat("assistant", "blue")}
    assert _tok(implicit, tokenizer) == _tok(explicit, tokenizer)


def test_standard_row_appends_eos_once_and_implicit_prompt_splits_at_whitespace(tokenizer):
    eos = tokenizer.eos_token_id
    out = _tok({"prompt": "the cat is", "chosen": " good", "rejected": " bad<|im_end|>"}, tokenizer)
    assert out["prompt_ids"] == _ids(tokenizer, "the cat is", special=True)
    assert out["chosen_ids"] == _ids(tokenizer, " good") + [eos]
    assert out["rejected_ids"] == _ids(tokenizer, " bad") + [eos]  # already ended with EOS: not doubled
    implicit = _tok({"chosen": "the cat is good", "rejected": "the cat is bad"}, tokenizer)
    assert implicit["prompt_ids"] == _ids(tokenizer, "the cat is ", special=True)
    assert implicit["chosen_ids"] == _ids(tokenizer, "good") + [eos]


def test_part_limits_keep_prompt_end_and_completion_start(tokenizer):
    prompt, chosen, rejected = "one two three four five six", " red green blue cat", " dog"
    p, c, r = _ids(tokenizer, prompt, True), _ids(tokenizer, chosen) + [2], _ids(tokenizer, rejected) + [2]
    assert len(p) > 4 and len(c) > 5
    row = {"prompt": prompt, "chosen": chosen, "rejected": rejected}
    out = _tok(row, tokenizer, max_prompt_length=4, max_completion_length=3)
    assert out == {"prompt_ids": p[-4:], "chosen_ids": c[:3], "rejected_ids": r[:3]}
    assert _tok(row, tokenizer) == {"prompt_ids": p, "chosen_ids": c, "rejected_ids": r}


@pytest.mark.parametrize("mode", ["keep_start", "keep_end"])
def test_collator_max_length_cuts_each_sequence_as_truncation_mode_says(mode):
    # TRL's rule: prompt + completion is cut to max_length, keeping its first (keep_start) or last (keep_end) tokens.
    rows = [{"prompt_ids": [1, 2, 3, 4], "chosen_ids": [5, 6, 7], "rejected_ids": [8]}]
    batch = PreferenceCollator(0, max_length=5, truncation_mode=mode)(rows)
    if mode == "keep_start":
        assert batch["input_ids"].tolist() == [[1, 2, 3, 4, 5], [1, 2, 3, 4, 8]]
        assert batch["completion_mask"].tolist() == [[0, 0, 0, 0, 1], [0, 0, 0, 0, 1]]
    else:  # the chosen sequence loses the start of its prompt; the short rejected one is untouched
        assert batch["input_ids"].tolist() == [[3, 4, 5, 6, 7], [1, 2, 3, 4, 8]]
        assert batch["completion_mask"].tolist() == [[0, 0, 1, 1, 1], [0, 0, 0, 0, 1]]
    assert batch["attention_mask"].tolist() == [[1] * 5, [1] * 5]
    free = PreferenceCollator(0, padding_free=True, max_length=5, truncation_mode=mode)(rows)
    assert free["input_ids"][0].tolist() == sum(batch["input_ids"].tolist(), [])


def test_collator_pads_to_a_multiple():
    rows = [{"prompt_ids": [1, 2], "chosen_ids": [3], "rejected_ids": [4, 5]}]
    batch = PreferenceCollator(0, pad_to_multiple_of=8)(rows)
    assert batch["input_ids"].tolist() == [[1, 2, 3, 0, 0, 0, 0, 0], [1, 2, 4, 5, 0, 0, 0, 0]]
    assert batch["attention_mask"].sum().item() == 7 and batch["completion_mask"].shape == (2, 8)


def test_rows_without_a_comparison_are_dropped_with_a_warning(tokenizer, caplog):
    rows = [
        {"prompt": "one two three four five six", "chosen": " red", "rejected": " dog"},
        {"prompt": "one", "chosen": " red", "rejected": " dog green blue"},
    ]
    prompt_len = len(_ids(tokenizer, rows[0]["prompt"], True))
    data = Dataset.from_list(rows)
    with caplog.at_level(logging.WARNING, logger="posttrain"):
        kept = prepare_preference_dataset(data, tokenizer, trainer="DPOTrainer", max_length=prompt_len)
    assert len(kept) == 1 and "Dropping 1 of 2 rows" in caplog.text  # its prompt alone fills max_length
    assert (
        len(
            prepare_preference_dataset(
                data, tokenizer, trainer="DPOTrainer", max_length=prompt_len, truncation_mode="keep_end"
            )
        )
        == 2
    )  # keep_end keeps every row
    # The reward trainer's rule (TRL's): drop a row when either full sequence exceeds max_length.
    first = prompt_len + max(len(_ids(tokenizer, " red")), len(_ids(tokenizer, " dog"))) + 1
    second = len(_ids(tokenizer, "one", True)) + len(_ids(tokenizer, " dog green blue")) + 1
    assert first != second
    kept = prepare_preference_dataset(
        data, tokenizer, trainer="RewardTrainer", max_length=min(first, second), truncation_mode="drop"
    )
    assert len(kept) == 1 and len(kept[0]["prompt_ids"]) == (
        prompt_len if first < second else len(_ids(tokenizer, "one", True))
    )
    with pytest.raises(DataError, match="Every row of train_dataset is dropped"):
        prepare_preference_dataset(data, tokenizer, trainer="DPOTrainer", max_length=1)


def test_collator_padded_batch_element_by_element():
    rows = [
        {"prompt_ids": [5, 6, 7], "chosen_ids": [8, 9], "rejected_ids": [10], "margin": 0.5},
        {"prompt_ids": [11], "chosen_ids": [12], "rejected_ids": [13, 14, 15], "margin": 2},
    ]
    batch = PreferenceCollator(pad_token_id=0)(rows)
    assert batch["input_ids"].tolist() == [
        [5, 6, 7, 8, 9],
        [11, 12, 0, 0, 0],  # prompt + chosen, one row per pair
        [5, 6, 7, 10, 0],
        [11, 13, 14, 15, 0],  # prompt + rejected
    ]
    assert batch["attention_mask"].tolist() == [[1, 1, 1, 1, 1], [1, 1, 0, 0, 0], [1, 1, 1, 1, 0], [1, 1, 1, 1, 0]]
    assert batch["completion_mask"].tolist() == [[0, 0, 0, 1, 1], [0, 1, 0, 0, 0], [0, 0, 0, 1, 0], [0, 1, 1, 1, 0]]
    assert batch["margin"].dtype == torch.float32 and batch["margin"].tolist() == [0.5, 2.0]
    assert set(batch) == {"input_ids", "attention_mask", "completion_mask", "margin"}


def test_collator_padding_free_restarts_positions_and_passes_ref_logps():
    rows = [
        {
            "prompt_ids": [5, 6],
            "chosen_ids": [8],
            "rejected_ids": [10, 11],
            "ref_chosen_logps": -1.5,
            "ref_rejected_logps": -2.5,
        },
        {
            "prompt_ids": [],
            "chosen_ids": [12, 13],
            "rejected_ids": [14],
            "ref_chosen_logps": -3.0,
            "ref_rejected_logps": -4.0,
        },
    ]
    batch = PreferenceCollator(pad_token_id=0, padding_free=True)(rows)
    assert batch["input_ids"].tolist() == [[5, 6, 8, 12, 13, 5, 6, 10, 11, 14]]
    assert batch["position_ids"].tolist() == [[0, 1, 2, 0, 1, 0, 1, 2, 3, 0]]
    # A sequence's first token is never a target (nothing in the sequence predicts it), even with no prompt.
    assert batch["completion_mask"].tolist() == [[0, 0, 1, 0, 1, 0, 0, 1, 1, 0]]
    assert batch["use_cache"] is False and "attention_mask" not in batch
    assert batch["ref_chosen_logps"].tolist() == [-1.5, -3.0]
    assert batch["ref_rejected_logps"].tolist() == [-2.5, -4.0]


def test_identical_pairs_are_reported_once_with_their_rows(tokenizer, caplog):
    rows = [{"prompt": "a", "chosen": " x", "rejected": " y"}] * 2 + [{"prompt": "a", "chosen": " z", "rejected": " z"}]
    rows += [{"prompt": "b", "chosen": " q", "rejected": " q"}]
    with caplog.at_level(logging.WARNING, logger="posttrain"):
        out = prepare_preference_dataset(Dataset.from_list(rows), tokenizer, trainer="T")
    warnings = [r.getMessage() for r in caplog.records if "identical chosen and rejected" in r.getMessage()]
    assert len(warnings) == 1
    assert warnings[0].startswith("2 row(s) of train_dataset") and "(rows 2, 3)" in warnings[0]
    assert out.column_names == ["prompt_ids", "chosen_ids", "rejected_ids"]


def test_dataset_checks_name_the_problem(tokenizer):
    with pytest.raises(DataError, match=r"columns found: \['prompt', 'chosen'\]"):
        prepare_preference_dataset(Dataset.from_list([{"prompt": "a", "chosen": "b"}]), tokenizer, trainer="T")
    rows = [{"prompt": _chat("user", "hi"), "chosen": "yes", "rejected": "no"}]
    with pytest.raises(DataError, match="Row 0: column 'chosen' is a string but the other columns are conversations"):
        prepare_preference_dataset(Dataset.from_list(rows), tokenizer, trainer="T")
    with pytest.raises(DataError, match="T: train_dataset is empty"):
        prepare_preference_dataset(Dataset.from_dict({"chosen": [], "rejected": []}), tokenizer, trainer="T")
