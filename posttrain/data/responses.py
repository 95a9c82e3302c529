"""A completion's token ids parsed into an assistant message (content, reasoning, tool calls), and the check that a
chat template's assistant mask ends on the token that ends the turn (TRL's `parse_response` and
`is_chat_template_stop_token_trained`, at `posttrain.chat_template_utils`)."""

from __future__ import annotations

import inspect
from collections.abc import Callable

from jinja2 import TemplateError
from transformers import ProcessorMixin


def _check_tool_calls(tool_calls) -> None:
    """ValueError unless every tool call is a {"type": "function", "function": {"name": str, "arguments": dict}} (a
    chat template that renders the calls back would otherwise fail on a missing field)."""
    if not isinstance(tool_calls, list):
        raise ValueError(f"tool_calls must be a list, got {type(tool_calls).__name__}")
    for call in tool_calls:
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise ValueError(f"malformed tool call {call!r}: it needs a function with a name")
        call.setdefault("type", "function")
        if function.get("arguments") is None:
            function["arguments"] = {}


def parse_response(
    tokenizer, ids: list[int], prefix: list[int] | None = None, tools: list[dict | Callable] | None = None
):
    """The assistant message that `ids` (a completion's token ids) encode, from the tokenizer's response parser
    (`tokenizer.parse_response`, set up by `add_response_schema`): {"role": "assistant", "content": str, ...} with
    "tool_calls" when the model called tools. `prefix` (the prompt's ids before the completion) and `tools` reach the
    parser when it takes them. A completion the parser cannot read (a malformed or truncated tool call) comes back
    as plain text: the decoded ids without special tokens as the content."""
    try:
        accepted = inspect.signature(tokenizer.parse_response).parameters
        kwargs = {}
        if prefix is not None and "prefix" in accepted and getattr(tokenizer, "response_template", None) is not None:
            kwargs["prefix"] = prefix
            if tools is not None and "tools" in accepted:
                kwargs["tools"] = tools
        parsed = tokenizer.parse_response(ids, **kwargs)
        if not isinstance(parsed, dict):  # nothing left to parse (a heavily truncated completion)
            raise ValueError("the response parser returned no message")
        content = parsed.get("content")
        if isinstance(content, str) and tokenizer.eos_token:
            content = content.removesuffix(tokenizer.eos_token)  # parsers may keep the EOS after tool calls
        parsed["content"] = content or ""
        if "tool_calls" in parsed:
            _check_tool_calls(parsed["tool_calls"])
    except (ValueError, TypeError):
        parsed = {"role": "assistant", "content": tokenizer.decode(ids, skip_special_tokens=True)}
    return parsed


def is_chat_template_stop_token_trained(processing_class, chat_template: str | None = None) -> bool:
    """True if the template's assistant mask (`{% generation %}` markers) ends an assistant turn on the token that
    ends the turn, so training teaches the model to stop. Rendered on user -> assistant -> user (some templates only
    close an assistant turn when another message follows); the last non-blank token of the assistant span must be
    one of the tokenizer's added tokens (turn terminators are). False without markers or when rendering fails."""
    messages = [{"role": role, "content": "probe"} for role in ("user", "assistant", "user")]
    vision = isinstance(processing_class, ProcessorMixin)
    if vision:
        messages = [{"role": m["role"], "content": [{"type": "text", "text": m["content"]}]} for m in messages]
    try:
        out = processing_class.apply_chat_template(
            messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True, chat_template=chat_template
        )
    except (TemplateError, TypeError, ValueError):
        return False
    ids, mask = out["input_ids"], out["assistant_masks"]
    if vision:
        ids, mask = ids[0], mask[0]
    tokenizer = processing_class.tokenizer if vision else processing_class
    added = set(tokenizer.get_added_vocab().values())
    trained = [token for token, bit in zip(ids, mask) if bit]
    for token in reversed(trained):
        if tokenizer.decode([token]).strip():
            return token in added
    return False


__all__ = ["is_chat_template_stop_token_trained", "parse_response"]
