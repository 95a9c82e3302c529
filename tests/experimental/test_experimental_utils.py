"""posttrain.experimental.utils (TRL's `trl.experimental.utils` path): truncate_dataset and DataCollatorForChatML."""

import pytest
from datasets import Dataset

from posttrain.experimental.utils import DataCollatorForChatML, truncate_dataset

ROWS = {
    "input_ids": [[1, 2, 3], [4, 5, 6, 7], [8]],
    "attention_mask": [[0, 1, 1], [0, 0, 1, 1], [1]],
    "tag": list("abc"),
}
CUT = {"input_ids": [[1, 2], [4, 5], [8]], "attention_mask": [[0, 1], [0, 0], [1]], "tag": list("abc")}


def test_truncate_dataset_cuts_list_columns_only_and_keeps_the_format():
    ds = Dataset.from_dict(ROWS).with_format("numpy", columns=["input_ids"], output_all_columns=True)
    out = truncate_dataset(ds, 2)
    assert out.format == ds.format
    assert out.with_format(None).to_dict() == CUT


def test_truncate_dataset_streams():
    ds = Dataset.from_dict(ROWS).to_iterable_dataset().with_format("numpy")
    out = truncate_dataset(ds, 2)
    assert out._formatting.format_type == "numpy"
    assert next(iter(out.with_format(None).batch(batch_size=3))) == CUT


CONVERSATION = [
    {"role": "user", "content": "What colour is the sky?"},
    {"role": "assistant", "content": "Blue."},
    {"role": "user", "content": "And grass?"},
    {"role": "assistant", "content": "Green, mostly."},
]


def test_chatml_collator_trains_the_last_assistant_turn(tokenizer):
    collator = DataCollatorForChatML(tokenizer=tokenizer)
    short = [CONVERSATION[0], CONVERSATION[1]]
    batch = collator([{"messages": CONVERSATION}, {"messages": short}])
    full = tokenizer.apply_chat_template(CONVERSATION, tokenize=False)
    prompt = tokenizer.apply_chat_template(CONVERSATION[:-1], tokenize=False, add_generation_prompt=True)
    ids = tokenizer(full, add_special_tokens=False)["input_ids"]
    n = len(tokenizer(prompt, add_special_tokens=False)["input_ids"])
    assert batch["input_ids"][0].tolist() == ids  # the longer row: no padding
    assert batch["prompts"][0].tolist() == ids[:n]
    assert batch["labels"][0].tolist() == [-100] * n + ids[n:]
    assert tokenizer.decode(ids[n:]).startswith("Green, mostly.")
    # the shorter row is left-padded in every tensor
    pad = len(ids) - int(batch["attention_mask"][1].sum())
    assert pad > 0 and batch["attention_mask"][1, :pad].sum() == 0
    assert (batch["input_ids"][1, :pad] == tokenizer.pad_token_id).all()
    assert (batch["labels"][1, :pad] == -100).all()
    assert batch["prompt_attention_mask"][1, -1] == 1


def test_chatml_collator_drops_the_oldest_tokens_and_refuses_a_row_without_prompt(tokenizer):
    ids = tokenizer(tokenizer.apply_chat_template(CONVERSATION, tokenize=False), add_special_tokens=False)["input_ids"]
    batch = DataCollatorForChatML(tokenizer=tokenizer, max_length=len(ids) - 3)([{"messages": CONVERSATION}])
    assert batch["input_ids"][0].tolist() == ids[3:]
    tokenized = {"input_ids": [5, 6, 7, 8], "completion_mask": [0, 0, 1, 1]}
    batch = DataCollatorForChatML(tokenizer=tokenizer)([tokenized])
    assert batch["labels"][0].tolist() == [-100, -100, 7, 8] and batch["prompts"][0].tolist() == [5, 6]
    with pytest.raises(ValueError, match="no prompt tokens"):
        DataCollatorForChatML(tokenizer=tokenizer, max_length=2)([{"messages": CONVERSATION}])
