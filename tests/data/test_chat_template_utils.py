"""`posttrain.chat_template_utils`, checked by rendering and parsing, and against TRL 1.16 where it imports."""

import pytest
from transformers import AutoTokenizer

from posttrain.chat_template_utils import (
    add_response_schema,
    clone_chat_template,
    get_training_chat_template,
    has_generation_markers,
    supports_tool_calling,
)

try:
    import trl.chat_template_utils as trl_ctu
except Exception:
    trl_ctu = None

# Test templates written here: a ChatML template that renders Hermes-style tool calls and tool results.
HERMES = (
    "{%- for m in messages %}"
    "{%- if m.role == 'assistant' %}{{- '<|im_start|>assistant\\n' + (m.content or '') }}"
    "{%- for tc in m.tool_calls or [] %}"
    '{{- \'<tool_call>\\n{"name": "\' + tc.function.name + \'", "arguments": \' }}'
    "{{- tc.function.arguments | tojson }}{{- '}\\n</tool_call>' }}{%- endfor %}{{- '<|im_end|>\\n' }}"
    "{%- elif m.role == 'tool' %}"
    "{{- '<|im_start|>user\\n<tool_response>\\n' + m.content + '\\n</tool_response><|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}{%- endif %}"
    "{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
# Llama 3.1 style: JSON calls with "parameters" after an assistant header.
LLAMA3 = (
    "{%- for m in messages %}{{- '<|start_header_id|>' + m.role + '<|end_header_id|>\\n\\n' }}"
    "{%- if m.tool_calls %}{%- for tc in m.tool_calls %}"
    '{{- \'{"name": "\' + tc.function.name + \'", "parameters": \' }}'
    "{{- tc.function.arguments | tojson }}{{- '}' }}{%- endfor %}{%- else %}{{- m.content }}{%- endif %}"
    "{{- '<|eot_id|>' }}{%- endfor %}"
)
# Rejects tool messages, as some real templates do.
STRICT = (
    "{%- for m in messages %}{%- if m.role not in ['user', 'assistant'] %}"
    "{{ raise_exception('roles must be user/assistant') }}{%- endif %}{{ m.content }}{%- endfor %}"
)
SMOL_LIKE = (
    "{%- if messages[0].role != 'system' %}{{- '<|im_start|>system\\nYou are a helpful bot.<|im_end|>\\n' }}"
    "{%- endif %}{%- for m in messages %}{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}"
    "{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def _with(tokenizer, template):
    tokenizer.chat_template = template
    return tokenizer


@pytest.mark.parametrize(
    "template, expected", [(None, False), ("chatml", False), (HERMES, True), (LLAMA3, True), (STRICT, False)]
)
def test_supports_tool_calling(fresh_tokenizer, template, expected):
    if template != "chatml":
        fresh_tokenizer.chat_template = template
    assert supports_tool_calling(fresh_tokenizer) is expected
    if trl_ctu is not None:
        assert trl_ctu.supports_tool_calling(fresh_tokenizer) is expected


def test_add_response_schema_parses_hermes_tool_calls(fresh_tokenizer):
    tok = add_response_schema(_with(fresh_tokenizer, HERMES))
    assert tok is fresh_tokenizer
    text = '<tool_call>\n{"name": "multiply", "arguments": {"a": 3, "b": 4}}\n</tool_call><|im_end|>'
    expected = {
        "role": "assistant",
        "tool_calls": [{"type": "function", "function": {"name": "multiply", "arguments": {"a": 3, "b": 4}}}],
    }
    prefix = "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    parsed = tok.parse_response(text, prefix=prefix)
    assert parsed == expected
    assert tok.parse_response("<think>hm</think>Blue.<|im_end|>", prefix=prefix)["content"] == "Blue."
    if trl_ctu is not None:
        for t in (text, "<think>hm</think>Blue.<|im_end|>", "Plain.<|im_end|>"):
            assert parsed is not None and tok.parse_response(t, prefix=prefix) == tok.parse_response(
                t, prefix=prefix, schema=trl_ctu.qwen3_template
            )


def test_add_response_schema_llama3_and_unknown(fresh_tokenizer):
    tok = add_response_schema(_with(fresh_tokenizer, LLAMA3))
    prefix = "<|start_header_id|>assistant<|end_header_id|>\n\n"
    parsed = tok.parse_response('{"name": "add", "parameters": {"x": 1}}<|eot_id|>', prefix=prefix)
    assert parsed["tool_calls"] == [{"type": "function", "function": {"name": "add", "arguments": {"x": 1}}}]
    if trl_ctu is not None:
        assert parsed == tok.parse_response(
            '{"name": "add", "parameters": {"x": 1}}<|eot_id|>', prefix=prefix, schema=trl_ctu.llama3_template
        )
    with pytest.raises(ValueError, match="Unrecognized chat template"):
        add_response_schema(_with(fresh_tokenizer, STRICT))


@pytest.mark.parametrize("template", ["chatml", SMOL_LIKE])
def test_training_template_renders_the_same_and_masks_assistant_turns(fresh_tokenizer, template):
    if template != "chatml":
        fresh_tokenizer.chat_template = template
    training = get_training_chat_template(fresh_tokenizer)
    assert has_generation_markers(training) and not has_generation_markers(fresh_tokenizer.chat_template)
    conversation = [
        {"role": "user", "content": "one"},
        {"role": "assistant", "content": "two"},
        {"role": "user", "content": "three"},
        {"role": "assistant", "content": "four"},
    ]
    original = fresh_tokenizer.apply_chat_template(conversation, tokenize=False)
    assert fresh_tokenizer.apply_chat_template(conversation, tokenize=False, chat_template=training) == original
    out = fresh_tokenizer.apply_chat_template(
        conversation, chat_template=training, return_dict=True, return_assistant_tokens_mask=True
    )
    trained = [t for t, m in zip(out["input_ids"], out["assistant_masks"]) if m]
    assert fresh_tokenizer.decode(trained) == "two<|im_end|>\nfour<|im_end|>\n"
    # Already fit: nothing to patch.
    fresh_tokenizer.chat_template = training
    assert get_training_chat_template(fresh_tokenizer) is None


def _trl_template(name):
    from pathlib import Path

    path = Path(trl_ctu.__file__).parent / "chat_templates" / f"{name}.jinja"
    return path.read_text() if path.exists() else pytest.skip(f"TRL ships no {name}.jinja")


@pytest.mark.skipif(trl_ctu is None, reason="TRL's copy of the Qwen 2.5 template is the test input")
def test_training_template_for_qwen2_5_with_tools(fresh_tokenizer):
    from posttrain.data.chat_templates import _PROBE_TOOLS, _PROBES, _TOOL_PROBES

    original = _with(fresh_tokenizer, _trl_template("qwen2_5")).chat_template
    training = get_training_chat_template(fresh_tokenizer)
    trl_training = trl_ctu.get_training_chat_template(fresh_tokenizer)
    for messages, gen in _PROBES + _TOOL_PROBES:
        for tools in (None, _PROBE_TOOLS):
            texts = {
                fresh_tokenizer.apply_chat_template(
                    messages, tools=tools, tokenize=False, chat_template=t, add_generation_prompt=gen
                )
                for t in (original, training, trl_training)
            }
            assert len(texts) == 1
    out = fresh_tokenizer.apply_chat_template(
        _TOOL_PROBES[0][0],
        tools=_PROBE_TOOLS,
        chat_template=training,
        return_dict=True,
        return_assistant_tokens_mask=True,
    )
    trained = fresh_tokenizer.decode([t for t, m in zip(out["input_ids"], out["assistant_masks"]) if m])
    call = '<tool_call>\n{"name": "get_time", "arguments": {"city": "Paris"}}\n</tool_call>'
    assert trained == f"{call}\n{call}<|im_end|>\nNine.<|im_end|>\n"
    fresh_tokenizer.chat_template = training
    assert get_training_chat_template(fresh_tokenizer) is None  # fit now, and prefix-preserving


def test_training_template_unsupported_and_deprecated_alias(fresh_tokenizer):
    with pytest.raises(ValueError, match="not training-compatible"):
        get_training_chat_template(_with(fresh_tokenizer, HERMES))  # calls rendered, but no tool list
    with pytest.raises(ValueError, match="not training-compatible"):
        get_training_chat_template(_with(fresh_tokenizer, LLAMA3))
    fresh_tokenizer.chat_template = SMOL_LIKE
    with pytest.warns(FutureWarning):
        assert get_training_chat_template(tokenizer=fresh_tokenizer) is not None
    with pytest.raises(TypeError):
        get_training_chat_template(fresh_tokenizer, tokenizer=fresh_tokenizer)


def _source_tokenizer(tmp_path, tiny_model_path):
    source = AutoTokenizer.from_pretrained(tiny_model_path)
    source.add_special_tokens({"additional_special_tokens": ["<|turn|>", "<|end_turn|>"]})
    source.eos_token = "<|end_turn|>"
    source.chat_template = "{% for m in messages %}<|turn|>{{ m.content }}<|end_turn|>{% endfor %}"
    source.save_pretrained(tmp_path / "source")
    return str(tmp_path / "source")


@pytest.mark.parametrize("multiple", [64, None])
def test_clone_chat_template(tmp_path, tiny_model_path, multiple):
    from transformers import AutoModelForCausalLM

    source = _source_tokenizer(tmp_path, tiny_model_path)
    model, tok = AutoModelForCausalLM.from_pretrained(tiny_model_path), AutoTokenizer.from_pretrained(tiny_model_path)
    before = len(tok.vocab)
    model, tok, added = clone_chat_template(model, tok, source, resize_to_multiple_of=multiple)
    assert tok.chat_template == AutoTokenizer.from_pretrained(source).chat_template
    assert tok.eos_token == "<|end_turn|>" and model.config.eos_token_id == tok.eos_token_id
    assert model.generation_config.eos_token_id == tok.eos_token_id
    assert len(tok.vocab) == model.vocab_size == model.get_input_embeddings().weight.shape[0]
    if multiple:
        assert model.vocab_size % multiple == 0
    else:
        assert model.vocab_size == before + 2
    assert tok.convert_ids_to_tokens(added[:2]) == ["<|turn|>", "<|end_turn|>"]
    assert len(added) == len(tok.vocab) - before
    if trl_ctu is not None:
        m2, t2 = AutoModelForCausalLM.from_pretrained(tiny_model_path), AutoTokenizer.from_pretrained(tiny_model_path)
        m2, t2, added2 = trl_ctu.clone_chat_template(m2, t2, source, resize_to_multiple_of=multiple)
        assert added == added2 and t2.get_vocab() == tok.get_vocab() and m2.vocab_size == model.vocab_size


@pytest.mark.skipif(trl_ctu is None, reason="TRL's copies of the Qwen templates are the test input")
@pytest.mark.parametrize("name", ["qwen2_5", "qwen3"])
def test_add_response_schema_on_qwen_templates_parses_like_trl(fresh_tokenizer, name):
    from copy import deepcopy

    fresh_tokenizer.chat_template = _trl_template(name)
    theirs = trl_ctu.add_response_schema(deepcopy(fresh_tokenizer))
    ours = add_response_schema(fresh_tokenizer)
    prefix = "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    for text in (
        '<think>\nsum\n</think>\n\n<tool_call>\n{"name": "add", "arguments": {"a": 1}}\n</tool_call><|im_end|>',
        "Just text.<|im_end|>",
    ):
        assert ours.parse_response(text, prefix=prefix) == theirs.parse_response(text, prefix=prefix)


def test_parse_response_reads_tool_calls_and_falls_back_to_text(fresh_tokenizer):
    from posttrain.chat_template_utils import parse_response

    tok = add_response_schema(_with(fresh_tokenizer, HERMES))
    prefix = tok("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")["input_ids"]
    ids = tok('<tool_call>\n{"name": "multiply", "arguments": {"a": 3, "b": 4}}\n</tool_call><|im_end|>')["input_ids"]
    parsed = parse_response(tok, ids, prefix=prefix)
    assert parsed["content"] == "" and parsed["tool_calls"][0]["function"] == {
        "name": "multiply",
        "arguments": {"a": 3, "b": 4},
    }
    broken = tok('<tool_call>\n{"name": "multiply", "argu</tool_call><|im_end|>')["input_ids"]
    assert parse_response(tok, broken, prefix=prefix) == {
        "role": "assistant",
        "content": tok.decode(broken, skip_special_tokens=True),
    }
    assert parse_response(tok, tok("Blue.<|im_end|>")["input_ids"], prefix=prefix)["content"] == "Blue."


def test_stop_token_trained_needs_the_end_of_turn_inside_the_assistant_mask(fresh_tokenizer):
    from posttrain.chat_template_utils import is_chat_template_stop_token_trained

    inside = (
        "{% for m in messages %}{{ '<|im_start|>' + m.role + '\\n' }}"
        "{% if m.role == 'assistant' %}{% generation %}{{ m.content + '<|im_end|>' }}{% endgeneration %}"
        "{% else %}{{ m.content + '<|im_end|>' }}{% endif %}{{ '\\n' }}{% endfor %}"
    )
    outside = inside.replace("{{ m.content + '<|im_end|>' }}{% endgeneration %}", "{{ m.content }}{% endgeneration %}")
    outside = outside.replace("{% else %}{{ m.content + '<|im_end|>' }}", "{% else %}{{ m.content + '<|im_end|>' }}")
    outside = outside.replace("{{ '\\n' }}", "{{ '' if m.role != 'assistant' else '<|im_end|>' }}{{ '\\n' }}")
    assert is_chat_template_stop_token_trained(fresh_tokenizer, inside)
    assert not is_chat_template_stop_token_trained(fresh_tokenizer, outside)
    assert not is_chat_template_stop_token_trained(
        fresh_tokenizer, "{% for m in messages %}{{ m.content }}{% endfor %}"
    )
