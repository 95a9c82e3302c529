"""Tool calls read with the tokenizer's response template (transformers' parse_response), as TRL reads them, with the
regex parsers as fallbacks: for Qwen, Llama 3, Mistral and gpt-oss turns, on tiny local tokenizers that carry each
family's special tokens, a chat template in its format and a response template written here."""

from __future__ import annotations

import pytest

from posttrain.generation import Completion
from posttrain.online.episodes import ToolRollouts, _Running
from posttrain.online.rollout import Episode
from posttrain.tools import (
    WITH_SPECIAL_TOKENS,
    ParseError,
    ToolCall,
    parse_tool_calls,
    parse_with_response_schema,
    regex_parser_for,
)


def add(a: int, b: int) -> int:
    """Adds two numbers.

    Args:
        a: The first number.
        b: The second number.
    """
    return a + b


_JSON_CALL = {"type": "function", "function": {"name": "{name}", "arguments": "{content}"}}

FAMILIES = {
    "qwen": dict(
        specials=[],
        added=["<tool_call>", "</tool_call>"],  # Qwen's are added tokens, not special ones
        template="{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
        "{% if tools %}<tool_call>{% endif %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}",
        header="<|im_start|>assistant\n",
        turn='Let me add.<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": "7"}}\n</tool_call><|im_end|>',
        response={
            "start_anchor": "<|im_start|>assistant\n",
            "fields": {
                "tool_calls": {
                    "open": "<tool_call>",
                    "close_pattern": r"</tool_call>\s*",
                    "repeats": True,
                    "content": "json",
                    "transform": {"type": "function", "function": "{content}"},
                },
                "content": {"close_pattern": r"<\|im_end\|>\s*", "content": "text"},
            },
        },
    ),
    "llama3": dict(
        specials=["<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>", "<|python_tag|>"],
        template="{% for m in messages %}<|start_header_id|>{{ m.role }}<|end_header_id|>\n\n{{ m.content }}<|eot_id|>"
        "{% endfor %}{% if tools %}Environment: ipython{% endif %}"
        "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}",
        header="<|start_header_id|>assistant<|end_header_id|>\n\n",
        turn='{"name": "add", "parameters": {"a": 1, "b": "7"}}<|eot_id|>',
        response={
            "start_anchor": "<|start_header_id|>assistant<|end_header_id|>\n\n",
            "fields": {
                "tool_calls": {
                    "open_pattern": r'(?:<\|python_tag\|>)?\{"name":\s*"(?P<name>[^"]+)",\s*"parameters":\s*',
                    "close_pattern": r"\}\s*(?:<\|eot_id\|>|<\|eom_id\|>)",
                    "repeats": True,
                    "content": "json",
                    "transform": _JSON_CALL,
                },
                "content": {"close_pattern": r"<\|eot_id\|>\s*", "content": "text"},
            },
        },
    ),
    "mistral": dict(
        specials=["[INST]", "[/INST]", "[TOOL_CALLS]", "[ARGS]", "</s>"],
        template="{% for m in messages %}[INST]{{ m.content }}[/INST]{% endfor %}{% if tools %}[TOOL_CALLS]{% endif %}",
        header="",
        turn='[TOOL_CALLS]add[ARGS]{"a": 1, "b": "7"}</s>',
        response={
            "start_anchor": "[/INST]",
            "fields": {
                "tool_calls": {
                    "open_pattern": r"\[TOOL_CALLS\](?P<name>[^\[]+)\[ARGS\]",
                    "close_pattern": r"</s>\s*",
                    "repeats": True,
                    "content": "json",
                    "transform": _JSON_CALL,
                },
                "content": {"close_pattern": r"</s>\s*", "content": "text"},
            },
        },
    ),
    "gpt-oss": dict(
        specials=["<|start|>", "<|channel|>", "<|message|>", "<|call|>", "<|end|>", "<|return|>", "<|constrain|>"],
        template="{% for m in messages %}<|start|>{{ m.role }}<|message|>{{ m.content }}<|end|>{% endfor %}"
        "{% if tools %}to=functions<|call|>{% endif %}{% if add_generation_prompt %}<|start|>assistant{% endif %}",
        header="<|start|>assistant",
        turn="<|channel|>analysis<|message|>Add them.<|end|><|start|>assistant<|channel|>commentary to=functions.add "
        '<|constrain|>json<|message|>{"a": 1, "b": "7"}<|call|>',
        response={
            "start_anchor": "<|start|>assistant",
            "fields": {
                "thinking": {"open": "<|channel|>analysis<|message|>", "close": "<|end|>", "content": "text"},
                "tool_calls": {
                    "open_pattern": r"<\|channel\|>commentary to=functions\.(?P<name>[^\s<]+)\s*"
                    r"(?:<\|constrain\|>json)?<\|message\|>",
                    "close": "<|call|>",
                    "repeats": True,
                    "content": "json",
                    "transform": _JSON_CALL,
                },
                "content": {"open": "<|channel|>final<|message|>", "close_pattern": r"<\|return\|>", "content": "text"},
            },
        },
    ),
}


def family_tokenizer(name: str, with_response_template: bool = True):
    from posttrain.models.tiny import build_tiny_tokenizer

    family = FAMILIES[name]
    tokenizer = build_tiny_tokenizer()
    tokenizer.add_special_tokens({"additional_special_tokens": family["specials"]})
    tokenizer.add_tokens(family.get("added", []))
    tokenizer.chat_template = family["template"]
    if with_response_template:
        tokenizer.response_template = {"defaults": {"role": "assistant"}, **family["response"]}
    return tokenizer


def _ids(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def _prefix(tokenizer, name: str) -> list[int]:
    text = tokenizer.apply_chat_template([{"role": "user", "content": "1 + 7?"}], tokenize=False)
    return _ids(tokenizer, text + FAMILIES[name]["header"])


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_the_response_template_reads_the_call_with_typed_arguments(name):
    tokenizer = family_tokenizer(name)
    turn = parse_with_response_schema(
        tokenizer, _ids(tokenizer, FAMILIES[name]["turn"]), _prefix(tokenizer, name), [add]
    )
    assert turn is not None and [(c.name, c.arguments) for c in turn.calls] == [("add", {"a": 1, "b": 7})]
    assert turn.calls[0].arguments["b"] == 7 and isinstance(turn.calls[0].arguments["b"], int)  # typed by the schema


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_the_regex_fallback_reads_the_same_call(name):
    tokenizer = family_tokenizer(name, with_response_template=False)
    parser = regex_parser_for(tokenizer)
    assert parser == {"qwen": "hermes"}.get(name, name)
    text = tokenizer.decode(
        _ids(tokenizer, FAMILIES[name]["turn"]), skip_special_tokens=parser not in WITH_SPECIAL_TOKENS
    )
    turn = parse_tool_calls(text, parser, tools=[add])
    assert [(c.name, c.arguments) for c in turn.calls] == [("add", {"a": 1, "b": 7})]


def _rollouts(tokenizer, parser="auto"):
    return ToolRollouts(None, tokenizer, [add], None, max_completion_length=256, max_iterations=None, parser=parser)


def _running(rollouts, tokenizer, name: str, turn_text: str) -> _Running:
    turn = _ids(tokenizer, turn_text)
    episode = Episode.single_turn(Completion(0, turn, None, True))
    return _Running(_prefix(tokenizer, name), 0, rollouts.executor, rollouts.schemas, episode)


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_tool_rollouts_read_turns_with_the_template_and_fall_back_to_the_regex(name, monkeypatch):
    tokenizer = family_tokenizer(name)
    rollouts = _rollouts(tokenizer)
    assert rollouts.use_schema and rollouts.parser == {"qwen": "hermes"}.get(name, name)
    turn = rollouts._parse_last_turn(_running(rollouts, tokenizer, name, FAMILIES[name]["turn"]))
    assert [(c.name, c.arguments) for c in turn.calls] == [("add", {"a": 1, "b": 7})]
    # a turn the template cannot read goes to the regex parser, which reports what is wrong with it
    monkeypatch.setattr(type(tokenizer), "parse_response", lambda *a, **k: (_ for _ in ()).throw(ValueError("x")))
    turn = rollouts._parse_last_turn(_running(rollouts, tokenizer, name, FAMILIES[name]["turn"]))
    assert [(c.name, c.arguments) for c in turn.calls] == [("add", {"a": 1, "b": 7})]


def test_an_explicit_parser_is_used_even_with_a_response_template():
    tokenizer = family_tokenizer("qwen")
    rollouts = _rollouts(tokenizer, parser="llama3")
    assert not rollouts.use_schema and rollouts.parser == "llama3"


def test_a_malformed_call_is_an_error_the_model_reads():
    tokenizer = family_tokenizer("qwen", with_response_template=False)
    rollouts = _rollouts(tokenizer)
    turn = rollouts._parse_last_turn(
        _running(rollouts, tokenizer, "qwen", '<tool_call>{"name": "add", "arguments": {"a": 1,</tool_call><|im_end|>')
    )
    assert not turn.calls and isinstance(turn.attempts[0], ParseError) and turn.attempts[0].kind == "invalid_json"


def test_gpt_oss_regex_reads_several_calls_and_the_final_message():
    text = (
        '<|channel|>commentary to=functions.add <|constrain|>json<|message|>{"a": 1, "b": 2}<|call|>'
        '<|start|>assistant<|channel|>commentary to=functions.add<|message|>{"a": 3, "b": 4}<|call|>'
        "<|channel|>final<|message|>Done.<|return|>"
    )
    turn = parse_tool_calls(text, "gpt-oss")
    assert [c.arguments for c in turn.calls] == [{"a": 1, "b": 2}, {"a": 3, "b": 4}] and turn.content == "Done."
    assert all(isinstance(c, ToolCall) for c in turn.attempts)


def test_mistral_regex_reads_the_v3_json_list():
    turn = parse_tool_calls(
        '[TOOL_CALLS][{"name": "add", "arguments": {"a": 1, "b": 2}}, {"name": "add", '
        '"arguments": {"a": 5, "b": 6}}]</s>',
        "mistral",
    )
    assert [c.arguments for c in turn.calls] == [{"a": 1, "b": 2}, {"a": 5, "b": 6}]
