"""Tool calls read with the tokenizer's response template, as TRL reads them.

A checkpoint whose tokenizer carries a response template (transformers' `response_template`, read by
`tokenizer.parse_response`; older transformers: the legacy `response_schema`) says itself how its turns hold
content and tool calls: Qwen's ``<tool_call>`` blocks, Llama 3's JSON, Mistral's ``[TOOL_CALLS]``, gpt-oss's
``to=functions.NAME`` channel. With `tool_call_parser="auto"` (the default) posttrain parses each model turn with
it, from the turn's token ids and the ids before it (the template may pre-write part of the turn); a turn the
template cannot read, and tokenizers without one, go to the regex parser the chat template calls for
(`regex_parser_for`).
"""

from __future__ import annotations

import json
from collections.abc import Sequence

from posttrain.tools.parsers import ParsedTurn, call_from
from posttrain.tools.schema import tool_schemas

__all__ = ["has_response_schema", "parse_with_response_schema", "regex_parser_for"]

# Markers of a chat template's tool-call format, in the order they are tried, and the regex parser that reads it.
_TEMPLATE_MARKERS = (
    ("[TOOL_CALLS]", "mistral"),
    ("to=functions", "gpt-oss"),
    ("<|call|>", "gpt-oss"),
    ("<|python_tag|>", "llama3"),
    ("ipython", "llama3"),
    ("<tool_call>", "hermes"),
)


def has_response_schema(tokenizer) -> bool:
    return any(getattr(tokenizer, name, None) is not None for name in ("response_template", "response_schema"))


def regex_parser_for(tokenizer) -> str:
    """The built-in regex parser whose format the tokenizer's chat template writes ('hermes' when none is seen)."""
    template = getattr(tokenizer, "chat_template", None) or ""
    template = " ".join(template.values()) if isinstance(template, dict) else template
    return next((parser for marker, parser in _TEMPLATE_MARKERS if marker in template), "hermes")


def parse_with_response_schema(
    tokenizer, turn_ids: Sequence[int], prefix_ids: Sequence[int], tools: Sequence | None = None
) -> ParsedTurn | None:
    """The turn as its response template reads it (calls typed by the tools' schemas), or None when the tokenizer
    has none or the template cannot read this turn (the caller's regex parser then does)."""
    if not has_response_schema(tokenizer):
        return None
    try:
        if getattr(tokenizer, "response_template", None) is not None:
            message = tokenizer.parse_response(
                list(turn_ids), prefix=list(prefix_ids), tools=tool_schemas(tools or ()) or None
            )
        else:  # the legacy schema takes neither the prefix nor the tools
            message = tokenizer.parse_response(list(turn_ids))
    except Exception:  # noqa: BLE001 - the model's text must not crash the rollout; the regex parser reads it
        return None
    if not isinstance(message, dict):
        return None
    calls = message.get("tool_calls") or []
    attempts = [call_from(call, json.dumps(call, default=str), ("arguments", "parameters")) for call in calls]
    content = message.get("content")
    return ParsedTurn(content.strip() if isinstance(content, str) else "", attempts)
