"""The online trainers' prompt handling (posttrain.online.prompts) on its own: a character tokenizer whose ids can be
written by hand, the tiny ChatML tokenizer for conversations, and tiny in-memory datasets."""

from types import SimpleNamespace

import pytest
from datasets import Dataset, IterableDataset

from posttrain.data.report import cut_column
from posttrain.errors import ConfigError, DataError
from posttrain.models.tiny import build_tiny_tokenizer
from posttrain.online.prompts import (
    column_names,
    model_context,
    refuse_stream_lookahead,
    require_prompt_column,
    tokenize_prompt,
)

CUT = cut_column("max_prompt_length")


def chars(text, add_special_tokens=True):
    """A tokenizer of one id per character (its code point); a BOS id 1 in front unless told not to."""
    return {"input_ids": ([1] if add_special_tokens else []) + [ord(c) for c in text]}


def test_a_text_prompt_is_tokenized_with_special_tokens_and_cut_from_its_start():
    out = tokenize_prompt({"prompt": "abcd"}, 0, chars, conversational=False, max_prompt_length=None)
    assert out == {"prompt_ids": [1, 97, 98, 99, 100], CUT: 0}
    out = tokenize_prompt({"prompt": "abcd"}, 0, chars, conversational=False, max_prompt_length=3)
    assert out == {"prompt_ids": [98, 99, 100], CUT: 2}  # the last 3 tokens kept, 2 counted as cut
    out = tokenize_prompt({"prompt": "ab"}, 0, chars, conversational=False, max_prompt_length=8)
    assert out == {"prompt_ids": [1, 97, 98], CUT: 0}


def test_a_conversation_gets_the_chat_template_and_its_generation_prompt_without_special_tokens():
    tokenizer = build_tiny_tokenizer()
    messages = [{"role": "user", "content": "hi"}]
    out = tokenize_prompt({"prompt": messages}, 0, tokenizer, conversational=True, max_prompt_length=None)
    expected = tokenizer("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False)
    assert out["prompt_ids"] == expected["input_ids"] and out[CUT] == 0


@pytest.mark.parametrize(
    "prompt, conversational",
    [("text", True), ([{"role": "user", "content": "hi"}], False), (7, False), ([], True)],
)
def test_a_prompt_unlike_row_0_is_refused_naming_its_row(prompt, conversational):
    with pytest.raises(DataError, match="Row 5, column 'prompt': expected"):
        tokenize_prompt({"prompt": prompt}, 5, chars, conversational=conversational, max_prompt_length=None)


def test_an_empty_prompt_is_refused():
    with pytest.raises(DataError, match="Row 2: the prompt is empty after tokenization"):
        tokenize_prompt({"prompt": ""}, 2, lambda text: {"input_ids": []}, False, None)


def test_a_prompt_that_fills_the_context_is_refused_with_the_fix():
    example = {"prompt": "abcdefg"}  # 8 tokens with the BOS
    assert tokenize_prompt(example, 0, chars, False, None, context=9)[CUT] == 0  # one token of room left
    with pytest.raises(DataError, match=r"Row 3: the prompt is 8 tokens.*context is 8 tokens.*Set max_prompt_length"):
        tokenize_prompt(example, 3, chars, False, None, context=8, room=2)
    with pytest.raises(DataError, match=r"Lower max_prompt_length=8 below the context \(e\.g\. 6\)"):
        tokenize_prompt(example, 3, chars, False, 8, context=8, room=2)
    assert tokenize_prompt(example, 3, chars, False, 6, context=8)["prompt_ids"] == [98, 99, 100, 101, 102, 103]


def test_model_context_reads_the_config_or_its_text_config():
    def model(**config):
        return SimpleNamespace(config=SimpleNamespace(**config))

    assert model_context(model(max_position_embeddings=128)) == 128
    assert model_context(model(text_config=SimpleNamespace(max_position_embeddings=64))) == 64
    assert model_context(model(max_position_embeddings=0)) is None
    assert model_context(model()) is None
    assert model_context(SimpleNamespace()) is None


def test_the_prompt_column_is_required_and_a_dataset_must_not_be_empty():
    require_prompt_column(Dataset.from_dict({"prompt": ["a"]}), "train_dataset")
    with pytest.raises(DataError, match=r"train_dataset needs a 'prompt' column .* \['question'\]; rename"):
        require_prompt_column(Dataset.from_dict({"question": ["a"]}), "train_dataset")
    with pytest.raises(DataError, match="eval_dataset is empty"):
        require_prompt_column(Dataset.from_dict({"prompt": []}), "eval_dataset")


def test_a_stream_shows_its_columns_in_its_first_row():
    def rows():
        yield {"prompt": "a", "answer": "b"}

    stream = IterableDataset.from_generator(rows)
    assert column_names(stream) == ["prompt", "answer"]
    require_prompt_column(stream, "train_dataset")
    assert column_names(Dataset.from_dict({"x": [1], "prompt": ["p"]})) == ["x", "prompt"]


def test_settings_that_read_prompts_out_of_order_refuse_a_stream():
    refuse_stream_lookahead(SimpleNamespace(async_generation_rounds=0, dynamic_sampling=False))
    refuse_stream_lookahead(SimpleNamespace())
    with pytest.raises(ConfigError, match="dynamic_sampling=True does not work with a streaming train_dataset"):
        refuse_stream_lookahead(SimpleNamespace(dynamic_sampling=True))
    with pytest.raises(ConfigError, match="async_generation_rounds=2 .* look their prompts up by index"):
        refuse_stream_lookahead(SimpleNamespace(async_generation_rounds=2))
