"""`posttrain.data_utils` against TRL 1.16's `trl.data_utils` on the same rows (standard and conversational),
plus hand-checked expectations that hold without TRL."""

import copy
import random

import pytest
from datasets import Dataset, DatasetDict

from posttrain import data_utils as du

try:
    import trl.data_utils as trl_du
except Exception:  # TRL is only there for side-by-side checks
    trl_du = None
needs_trl = pytest.mark.skipif(trl_du is None, reason="trl is not importable")

U = {"role": "user", "content": "What color is the sky?"}
A = {"role": "assistant", "content": "It is blue."}
B = {"role": "assistant", "content": "It is green."}
S = {"role": "system", "content": "Be brief."}
T = {"role": "tool", "content": "42"}

ROWS = [
    {"messages": [U, A]},
    {"messages": [S, U, A]},
    {"prompt": [U]},
    {"prompt": [S, U]},
    {"prompt": [U, A]},  # continued, not answered
    {"prompt": [U], "completion": [A]},
    {"prompt": [U], "chosen": [A], "rejected": [B]},
    {"chosen": [U, A], "rejected": [U, B]},
    {"prompt": [U], "completion": [A], "label": True},
    {"prompt": [U, A, {"role": "user", "content": "Sure?"}], "completion": [B]},
]
STANDARD = [
    {"text": "The sky is blue."},
    {"prompt": "The sky is"},
    {"prompt": "The sky is", "completion": " blue."},
    {"prompt": "The sky is", "chosen": " blue.", "rejected": " green."},
]


@needs_trl
@pytest.mark.parametrize("row", ROWS + STANDARD)
def test_apply_chat_template_matches_trl(row, tokenizer):
    assert du.maybe_apply_chat_template(row, tokenizer) == trl_du.maybe_apply_chat_template(row, tokenizer)
    assert du.is_conversational(row) == trl_du.is_conversational(row)


def test_apply_chat_template_by_hand(tokenizer):
    out = du.apply_chat_template({"prompt": [U], "chosen": [A], "rejected": [B]}, tokenizer)
    assert out == {
        "prompt": "<|im_start|>user\nWhat color is the sky?<|im_end|>\n<|im_start|>assistant\n",
        "chosen": "It is blue.<|im_end|>\n",
        "rejected": "It is green.<|im_end|>\n",
    }
    # An assistant-ended prompt is continued: no end-of-turn after it.
    cont = du.apply_chat_template({"prompt": [U, A]}, tokenizer)["prompt"]
    assert cont.endswith("It is blue.") and cont.count("<|im_start|>assistant") == 1
    with pytest.raises(KeyError, match="Invalid keys"):
        du.apply_chat_template({"prompt": [U], "messages": [U, A]}, tokenizer)
    with pytest.raises(ValueError, match="last message"):
        du.apply_chat_template({"prompt": [S]}, tokenizer)


def test_apply_chat_template_cuts_prompt_to_the_shared_prefix(fresh_tokenizer):
    # A template that renders a lone prompt with a thinking block the full conversation drops: the prompt is
    # cut to what both renderings share and the completion starts there.
    fresh_tokenizer.chat_template = (
        "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}</s>{% endfor %}"
        "{% if add_generation_prompt %}<assistant><think></think>{% endif %}"
    )
    out = du.apply_chat_template({"prompt": [U], "completion": [A]}, fresh_tokenizer)
    assert out == {"prompt": "<user>What color is the sky?</s><assistant>", "completion": "It is blue.</s>"}
    if trl_du is not None:
        assert out == trl_du.apply_chat_template({"prompt": [U], "completion": [A]}, fresh_tokenizer)


@pytest.mark.parametrize(
    "row, expected",
    [
        ({"messages": [U]}, True),
        ({"prompt": "a"}, False),
        ({"text": "a"}, False),
        ({"chosen": [U, A], "rejected": [U, B]}, True),
        ({"completion": [A]}, True),
        ({"conversations": [{"from": "human", "value": "hi"}]}, False),
        ({"messages": [{"from": "human", "value": "hi"}]}, False),
    ],
)
def test_is_conversational(row, expected):
    assert du.is_conversational(row) is expected
    if trl_du is not None:
        assert trl_du.is_conversational(row) is expected


@pytest.mark.parametrize(
    "chosen, rejected",
    [
        ("The sky is blue.", "The sky is green."),
        ("The sky is blue.", "The sky is bluer."),  # differ mid-word
        ("abc", "abcd"),  # one a prefix of the other
        ("same", "same"),
        ([U, A], [U, B]),
        ([S, U, A], [S, U, B]),
        ([U, A], [U, A]),
    ],
)
def test_extract_prompt(chosen, rejected):
    out = du.extract_prompt({"chosen": chosen, "rejected": rejected})
    # The pieces put back together give the originals.
    assert out["prompt"] + out["chosen"] == chosen and out["prompt"] + out["rejected"] == rejected
    if trl_du is not None:
        assert out == trl_du.extract_prompt({"chosen": chosen, "rejected": rejected})


def test_extract_prompt_by_hand():
    assert du.extract_prompt({"chosen": "The sky is blue.", "rejected": "The sky is green."}) == {
        "prompt": "The sky is",
        "chosen": " blue.",
        "rejected": " green.",
    }
    assert du.extract_prompt({"chosen": [U, A], "rejected": [U, B]}) == {"prompt": [U], "chosen": [A], "rejected": [B]}


@pytest.mark.parametrize(
    "row",
    [
        {"chosen": [U, A], "rejected": [U, B]},
        {"prompt": [U], "chosen": [A], "rejected": [B]},
        {"prompt": "What color is the sky?", "chosen": [U, A], "rejected": [U, B]},  # string prompt beside chats
        {"prompt": "The sky is", "chosen": " blue.", "rejected": " green."},
        {"chosen": "The sky is blue.", "rejected": "The sky is green."},
        {"prompt": [U], "completion": [A]},  # not a preference row
    ],
)
def test_maybe_extract_prompt(row):
    out = du.maybe_extract_prompt(copy.deepcopy(row))
    assert out["prompt"] in ([U], "The sky is")
    if trl_du is not None:
        assert out == trl_du.maybe_extract_prompt(copy.deepcopy(row))


def test_unpair_preference_dataset():
    ds = Dataset.from_dict({"prompt": ["p1", "p2"], "chosen": ["c1", "c2"], "rejected": ["r1", "r2"], "id": [1, 2]})
    out = du.unpair_preference_dataset(ds)
    assert out.to_dict() == {
        "completion": ["c1", "c2", "r1", "r2"],
        "label": [True, True, False, False],
        "prompt": ["p1", "p2", "p1", "p2"],
        "id": [1, 2, 1, 2],
    }
    assert du.maybe_unpair_preference_dataset(out) is out  # already unpaired: unchanged
    dd = DatasetDict(train=ds, test=ds)
    assert du.maybe_unpair_preference_dataset(dd)["test"].to_dict() == out.to_dict()
    if trl_du is not None:
        for fn in ("unpair_preference_dataset", "maybe_unpair_preference_dataset"):
            assert getattr(du, fn)(ds).to_dict() == getattr(trl_du, fn)(ds).to_dict()
        implicit = Dataset.from_dict({"chosen": [[U, A]], "rejected": [[U, B]]})
        assert du.unpair_preference_dataset(implicit).to_list() == trl_du.unpair_preference_dataset(implicit).to_list()


def test_sharegpt_helpers():
    row = {"conversations": [{"from": "user", "value": "hi"}, {"from": "assistant", "value": "yo"}]}
    assert du.is_conversational_from_value(row)
    assert not du.is_conversational_from_value({"conversations": [U]})
    assert not du.is_conversational_from_value({"conversations": "text"})
    out = du.maybe_convert_to_chatml(copy.deepcopy(row))
    assert out == {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}
    assert du.maybe_convert_to_chatml({"prompt": [U]}) == {"prompt": [U]}
    if trl_du is not None:
        assert trl_du.maybe_convert_to_chatml(copy.deepcopy(row)) == out
        pref = {"prompt": [{"from": "user", "value": "q"}], "chosen": [{"from": "assistant", "value": "a"}]}
        assert du.maybe_convert_to_chatml(copy.deepcopy(pref)) == trl_du.maybe_convert_to_chatml(copy.deepcopy(pref))


def test_prepare_multimodal_messages():
    messages = [S, U, A, {"role": "user", "content": "And now?"}]
    out = du.prepare_multimodal_messages(messages, images=["img0", "img1"])
    assert out[1]["content"] == [
        {"type": "image", "image": "img0"},
        {"type": "image", "image": "img1"},
        {"type": "text", "text": U["content"]},
    ]
    assert out[0]["content"] == [{"type": "text", "text": "Be brief."}]
    assert out[3]["content"] == [{"type": "text", "text": "And now?"}]
    assert messages[1] is U and isinstance(U["content"], str)  # inputs untouched
    # Already structured messages: only empty image blocks are filled, in order.
    structured = [
        {
            "role": "user",
            "content": [{"type": "image", "image": "kept"}, {"type": "image"}, {"type": "text", "text": "x"}],
        }
    ]
    filled = du.prepare_multimodal_messages(structured, images=["new"])
    assert [p.get("image") for p in filled[0]["content"]] == ["kept", "new", None]
    with pytest.raises(ValueError, match="does not match"):
        du.prepare_multimodal_messages(structured, images=[])
    with pytest.raises(ValueError, match="Invalid role"):
        du.prepare_multimodal_messages([{"role": "narrator", "content": "x"}])
    tool_call = [U, {"role": "assistant", "tool_calls": [{"type": "function"}]}, T]
    if trl_du is not None:
        for msgs, imgs in ((messages, ["a", "b"]), (structured, ["new"]), (tool_call, ["i"]), (messages, None)):
            assert du.prepare_multimodal_messages(copy.deepcopy(msgs), imgs) == trl_du.prepare_multimodal_messages(
                copy.deepcopy(msgs), imgs
            )


def test_small_helpers():
    assert du.common_prefix_length([1, 2, 3, 4], [1, 2, 5]) == 2
    assert du.common_prefix_length([], [1]) == 0
    assert du.common_prefix_length([7, 8], [7, 8, 9]) == 2
    ds = Dataset.from_dict({"a": [1], "b": [2]})
    assert du.get_dataset_column_names(ds) == ["a", "b"]
    stream = Dataset.from_dict({"a": [1], "b": [2]}).to_iterable_dataset().map(lambda r: {"c": 3})
    if trl_du is not None:
        assert du.get_dataset_column_names(stream) == trl_du.get_dataset_column_names(stream)
    assert set(du.get_dataset_column_names(stream)) == {"a", "b", "c"}


@needs_trl
def test_pack_dataset_matches_trl_on_random_rows():
    rng = random.Random(0)
    for _ in range(15):
        lengths = [rng.randint(0, 12) for _ in range(rng.randint(1, 25))]
        ids = [[rng.randint(0, 99) for _ in range(n)] for n in lengths]
        ds = Dataset.from_dict({"input_ids": ids, "attention_mask": [[1] * n for n in lengths]})
        for strategy in ("bfd", "bfd_split", "wrapped"):
            seq_length = rng.randint(1, 15)
            ours = du.pack_dataset(ds, seq_length, strategy, map_kwargs={"batch_size": 7})
            theirs = trl_du.pack_dataset(ds, seq_length, strategy, map_kwargs={"batch_size": 7})
            assert ours.to_dict() == theirs.to_dict(), (strategy, seq_length, lengths)


def test_pack_dataset_by_hand():
    ds = Dataset.from_dict(
        {
            "input_ids": [[1, 2, 3, 4, 5], [6, 7], [8, 9, 10], [11]],
            "attention_mask": [[1, 1, 1, 0, 0], [1, 0], [1, 1, 0], [1]],
        }
    )
    assert du.pack_dataset(ds, 4, "bfd").to_dict() == {
        "input_ids": [[1, 2, 3, 4], [8, 9, 10, 11], [6, 7]],
        "attention_mask": [[1, 1, 1, 0], [1, 1, 0, 1], [1, 0]],
        "seq_lengths": [[4], [3, 1], [2]],
    }
    assert du.pack_dataset(ds, 4, "bfd_split")["input_ids"] == [[1, 2, 3, 4], [8, 9, 10, 5], [6, 7, 11]]
    torch_ds = du.pack_dataset(ds.with_format("torch", columns=["input_ids"]), 4)
    assert torch_ds.format["columns"] == ["input_ids", "seq_lengths"] and torch_ds[0]["input_ids"].tolist() == [
        1,
        2,
        3,
        4,
    ]
    with pytest.raises(TypeError, match="lists of lists"):
        du.pack_dataset(Dataset.from_dict({"input_ids": [[1]], "id": [0]}), 4)
    with pytest.raises(ValueError, match="Invalid packing strategy"):
        du.pack_dataset(ds, 4, "first_fit")
