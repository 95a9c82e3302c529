"""Trained-token masks, element by element, on hand-built examples."""

import pytest

from posttrain.data.formats import detect_format
from posttrain.data.tokenize import assistant_spans, tokenize_example
from posttrain.errors import DataError


def _trained_text(tokenizer, out):
    return "".join(tokenizer.decode([t]) for t, m in zip(out["input_ids"], out["completion_mask"]) if m)


def _untrained_text(tokenizer, out):
    return "".join(tokenizer.decode([t]) for t, m in zip(out["input_ids"], out["completion_mask"]) if not m)


def test_assistant_only_multi_turn_with_system(tokenizer):
    messages = [
        {"role": "system", "content": "be good"},
        {"role": "user", "content": "hello"},
        {"role": "assistant", "content": "yes"},
        {"role": "user", "content": "why"},
        {"role": "assistant", "content": "because so"},
    ]
    ex = {"messages": messages}
    fmt = detect_format(ex.keys(), ex)
    assert fmt.conversational and fmt.kind == "language_modeling"
    out = tokenize_example(ex, tokenizer, fmt, assistant_only_loss=True)
    text = tokenizer.decode(out["input_ids"])
    assert text == tokenizer.apply_chat_template(messages, tokenize=False)
    # Exactly the two assistant contents and the <|im_end|> closing each are trained; nothing else.
    assert _trained_text(tokenizer, out) == "yes<|im_end|>because so<|im_end|>"
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    ends = [i for i, t in enumerate(out["input_ids"]) if t == im_end]
    assert len(ends) == 5
    assert [out["completion_mask"][i] for i in ends] == [0, 0, 1, 0, 1]
    # The newline after each <|im_end|> is not trained.
    assert all(out["completion_mask"][i + 1] == 0 for i in ends if i + 1 < len(out["input_ids"]))
    untrained = _untrained_text(tokenizer, out)
    assert "<|im_start|>assistant\n" in untrained and "hello" in untrained and "why" in untrained


def test_assistant_spans_are_character_exact(tokenizer):
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "red sky"}]
    text, spans = assistant_spans(tokenizer, messages)
    assert [text[s:e] for s, e in spans] == ["red sky<|im_end|>"]


def test_conversational_lm_without_assistant_only_trains_everything(tokenizer):
    ex = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yes"}]}
    out = tokenize_example(ex, tokenizer, detect_format(ex.keys(), ex))
    assert all(out["completion_mask"])


def test_conversational_prompt_completion(tokenizer):
    ex = {
        "prompt": [{"role": "user", "content": "one plus two"}],
        "completion": [{"role": "assistant", "content": "three"}],
    }
    fmt = detect_format(ex.keys(), ex)
    assert fmt.kind == "prompt_completion" and fmt.conversational
    out = tokenize_example(ex, tokenizer, fmt)
    assert _trained_text(tokenizer, out) == "three<|im_end|>"
    assert _untrained_text(tokenizer, out) == "<|im_start|>user\none plus two<|im_end|>\n<|im_start|>assistant\n\n"
    # Mask is contiguous: zeros, then ones, then the trailing newline.
    m = out["completion_mask"]
    first = m.index(1)
    assert m[first : first + sum(m)] == [1] * sum(m) and m[-1] == 0


def test_standard_prompt_completion_appends_trained_eos(tokenizer):
    ex = {"prompt": "two plus two is", "completion": " four"}
    out = tokenize_example(ex, tokenizer, detect_format(ex.keys(), ex))
    assert out["input_ids"][-1] == tokenizer.eos_token_id
    assert _trained_text(tokenizer, out) == " four<|im_end|>"
    assert tokenizer.decode(out["input_ids"]) == "two plus two is four<|im_end|>"
    # completion_only_loss=False trains the prompt too.
    out_all = tokenize_example(ex, tokenizer, detect_format(ex.keys(), ex), completion_only_loss=False)
    assert all(out_all["completion_mask"]) and out_all["input_ids"] == out["input_ids"]


def test_text_eos_is_configurable(tokenizer):
    ex = {"text": "the cat"}
    fmt = detect_format(ex.keys(), ex)
    with_eos = tokenize_example(ex, tokenizer, fmt)
    without = tokenize_example(ex, tokenizer, fmt, add_eos=False)
    assert with_eos["input_ids"] == without["input_ids"] + [tokenizer.eos_token_id]
    assert with_eos["completion_mask"] == [1] * len(with_eos["input_ids"])


def test_truncation_that_cuts_every_trained_token_names_the_row(tokenizer):
    ex = {"prompt": "the cat is on the tree and the dog is", "completion": " red"}
    with pytest.raises(DataError, match=r"Row 7: .*max_length=3"):
        tokenize_example(ex, tokenizer, detect_format(ex.keys(), ex), row=7, max_length=3)


def test_fully_masked_example_names_the_row(tokenizer):
    ex = {"prompt": "the cat", "completion": ""}
    fmt = detect_format(ex.keys(), ex)
    with pytest.raises(DataError, match="Row 3 has no tokens to train on"):
        tokenize_example(ex, tokenizer, fmt, row=3, add_eos=False)


def test_template_that_rewrites_earlier_turns_falls_back_to_content_search(fresh_tokenizer):
    # A template that drops earlier assistant turns' "<think>" part, like reasoning models' templates do.
    fresh_tokenizer.chat_template = (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
        "{% if m['role'] == 'assistant' and not loop.last %}{{ m['content'].split('</think>')[-1] }}"
        "{% else %}{{ m['content'] }}{% endif %}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    messages = [
        {"role": "user", "content": "a"},
        {"role": "assistant", "content": "<think>x</think>one"},
        {"role": "user", "content": "b"},
        {"role": "assistant", "content": "<think>y</think>two"},
    ]
    text, spans = assistant_spans(fresh_tokenizer, messages)
    assert [text[s:e] for s, e in spans] == ["one<|im_end|>", "<think>y</think>two<|im_end|>"]


def test_token_straddling_the_prompt_boundary_is_trained(tokenizer):
    # Byte-level BPE puts the prompt's trailing space into the completion's first token (" red").
    ex = {"prompt": "the sky is ", "completion": "red"}
    out = tokenize_example(ex, tokenizer, detect_format(ex.keys(), ex))
    assert _trained_text(tokenizer, out) == " red<|im_end|>"
    assert _untrained_text(tokenizer, out) == "the sky is"
