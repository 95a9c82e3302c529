"""Format detection and the bad-input errors, one test per case, asserting the message."""

import pytest
from datasets import Dataset

from posttrain.data import apply_chat_template, extract_prompt, is_conversational, unpair_preference_dataset
from posttrain.data.chat import convert_sharegpt
from posttrain.data.formats import check_example, detect_format, validate_dataset
from posttrain.errors import DataError

U = {"role": "user", "content": "hi"}
A = {"role": "assistant", "content": "yes"}


@pytest.mark.parametrize(
    "row, kind, conversational",
    [
        ({"text": "a"}, "language_modeling", False),
        ({"messages": [U, A]}, "language_modeling", True),
        ({"prompt": "a"}, "prompt_only", False),
        ({"prompt": [U]}, "prompt_only", True),
        ({"prompt": "a", "completion": "b"}, "prompt_completion", False),
        ({"prompt": [U], "completion": [A]}, "prompt_completion", True),
        ({"prompt": "a", "chosen": "b", "rejected": "c"}, "preference", False),
        ({"chosen": [U, A], "rejected": [U, A]}, "preference", True),
        ({"prompt": "a", "completion": "b", "label": True}, "unpaired_preference", False),
        ({"prompt": "a", "completions": ["b", "c"], "labels": [True, False]}, "stepwise_supervision", False),
    ],
)
def test_detect_every_format(row, kind, conversational):
    fmt = detect_format(row.keys(), row)
    assert (fmt.kind, fmt.conversational) == (kind, conversational)
    assert is_conversational(row) == conversational
    check_example(row, fmt, 0)


def test_implicit_vs_explicit_prompt():
    assert not detect_format(["chosen", "rejected"]).has_explicit_prompt
    assert detect_format(["prompt", "chosen", "rejected"]).has_explicit_prompt


def test_empty_dataset():
    with pytest.raises(DataError, match="SFTTrainer: train_dataset is empty"):
        validate_dataset(Dataset.from_dict({"text": []}), ["language_modeling"], "SFTTrainer")


def test_no_recognised_columns_lists_formats_and_columns():
    with pytest.raises(DataError) as e:
        validate_dataset(Dataset.from_dict({"question": ["a"], "answer": ["b"]}), ["language_modeling"], "SFTTrainer")
    msg = str(e.value)
    assert "['question', 'answer']" in msg and "prompt, completion" in msg and "text | messages" in msg


def test_messages_under_another_column_name():
    ds = Dataset.from_list([{"conversations": [U, A]}])
    with pytest.raises(DataError, match=r"Column 'conversations' holds a conversation: rename it to 'messages'"):
        validate_dataset(ds, ["language_modeling"], "SFTTrainer")


def test_unknown_role():
    ds = Dataset.from_list([{"messages": [U, {"role": "robot", "content": "x"}]}])
    with pytest.raises(DataError, match=r"Row 0, column 'messages', message 1: role 'robot' is not one of"):
        validate_dataset(ds, ["language_modeling"], "SFTTrainer")


def test_message_without_content():
    with pytest.raises(DataError, match=r"Row 4, column 'messages', message 0 \(role 'user'\) has no 'content'"):
        check_example({"messages": [{"role": "user"}]}, detect_format(["messages"], {"messages": [U]}), 4)


def test_mixed_conversational_prompt_and_string_completion():
    ds = Dataset.from_list([{"prompt": [U], "completion": "yes"}])
    with pytest.raises(
        DataError, match=r"Row 0: column 'completion' is a string but the other columns are conversations"
    ):
        validate_dataset(ds, ["prompt_completion"], "SFTTrainer")


def test_wrong_format_for_trainer_names_accepted_formats():
    ds = Dataset.from_list([{"prompt": "a", "chosen": "b", "rejected": "c"}])
    with pytest.raises(DataError, match=r"SFTTrainer does not train on preference data .* accepts: language-modeling"):
        validate_dataset(ds, ["language_modeling", "prompt_completion"], "SFTTrainer")


def test_string_label_in_unpaired_data():
    ds = Dataset.from_list([{"prompt": "a", "completion": "b", "label": "good"}])
    with pytest.raises(DataError, match=r"Row 0, column 'label': expected a boolean"):
        validate_dataset(ds, ["unpaired_preference"], "KTOTrainer")


def test_sharegpt_conversion():
    out = convert_sharegpt(
        [{"from": "system", "value": "s"}, {"from": "human", "value": "q"}, {"from": "gpt", "value": "a"}]
    )
    assert out == [
        {"role": "system", "content": "s"},
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": "a"},
    ]


def test_extract_prompt_conversational_and_string():
    row = {"chosen": [U, A], "rejected": [U, {"role": "assistant", "content": "no"}]}
    out = extract_prompt(row)
    assert out["prompt"] == [U] and out["chosen"] == [A] and out["rejected"] == [{"role": "assistant", "content": "no"}]
    out = extract_prompt({"chosen": "The sky is blue.", "rejected": "The sky is green."})
    # TRL's rule: the space before the first differing word goes to the completions.
    assert (out["prompt"], out["chosen"], out["rejected"]) == ("The sky is", " blue.", " green.")


def test_unpair_preference_dataset():
    ds = Dataset.from_list([{"prompt": "p", "chosen": "c", "rejected": "r"}])
    out = unpair_preference_dataset(ds)
    assert sorted(out.to_list(), key=lambda r: not r["label"]) == [
        {"prompt": "p", "completion": "c", "label": True},
        {"prompt": "p", "completion": "r", "label": False},
    ]


def test_apply_chat_template_keeps_format(tokenizer):
    out = apply_chat_template({"prompt": [U], "completion": [A]}, tokenizer)
    assert out["prompt"] == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert out["completion"] == "yes<|im_end|>\n"
    assert apply_chat_template({"messages": [U, A]}, tokenizer)["text"] == out["prompt"] + out["completion"]
