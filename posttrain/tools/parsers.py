"""Tool calls out of completion text, in the format the chat template taught the model.

A parser turns one assistant turn's text into a `ParsedTurn`: the calls (`ToolCall(name, arguments, raw)`), the
text outside them, and the calls it could not read (`ParseError`: invalid JSON, an unterminated block, no name,
an unknown tool). Errors are values, not exceptions, so the rollout can hand them back to the model as a tool
message and carry on.

Built in: ``"hermes"`` (alias ``"qwen"``): ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks, any
number per turn; ``"llama3"``: JSON objects ``{"name": ..., "parameters": {...}}`` (``"arguments"`` also read), after
an optional ``<|python_tag|>``, several separated by ``;`` or newlines; ``"mistral"``: ``[TOOL_CALLS]`` followed by a
JSON list or ``NAME[ARGS]{...}``; ``"gpt-oss"``: harmony's ``to=functions.NAME ... <|message|>{...}<|call|>``. These
are the fallbacks: a tokenizer with a response template is read with it (response_schema.py). Others plug in
with `register_parser(name, fn)` or ``parser=fn``; ``fn(text)`` returns a `ParsedTurn`, or a list of `ToolCall`s /
``{"name", "arguments"}`` dicts.

Given the tools' schemas, arguments written as strings are cast to the declared type (``"7"`` -> ``7`` for an
integer), as transformers' ``parse_response(tools=...)`` does in TRL.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from posttrain.errors import ConfigError
from posttrain.tools.schema import describe_arguments, tool_schemas


@dataclass
class ToolCall:
    """One call the model wrote: the tool's name, its arguments, and the exact text it came from."""

    name: str
    arguments: dict[str, Any]
    raw: str = ""

    def as_message_call(self) -> dict:
        """The call as an assistant message's ``tool_calls`` entry (what chat templates render)."""
        return {"type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass
class ParseError:
    """A call the model attempted but that cannot be run. `kind`: ``invalid_json``, ``partial`` (unterminated),
    ``bad_format`` (no name / arguments not an object), ``unknown_tool``, ``parser_error`` (a custom parser raised)."""

    kind: str
    message: str
    raw: str = ""
    name: str | None = None


@dataclass
class ParsedTurn:
    """One assistant turn: the text outside the calls, and every call attempt (`ToolCall` or `ParseError`) in the
    order the model wrote them (tool results go back in that order)."""

    content: str
    attempts: list[ToolCall | ParseError] = field(default_factory=list)

    @property
    def calls(self) -> list[ToolCall]:
        return [a for a in self.attempts if isinstance(a, ToolCall)]

    @property
    def errors(self) -> list[ParseError]:
        return [a for a in self.attempts if isinstance(a, ParseError)]

    @property
    def has_calls(self) -> bool:
        """True if the model tried to call a tool (a readable call or an error it should hear about)."""
        return bool(self.attempts)


def _json_object(text: str) -> tuple[Any, str | None, str | None]:
    """(value, error kind, message) of a JSON text; a text that ends before the JSON does is "partial"."""
    try:
        return json.loads(text), None, None
    except json.JSONDecodeError as error:
        kind = "partial" if error.pos >= len(text.rstrip()) else "invalid_json"
        return None, kind, f"{error.msg} at character {error.pos}"


def call_from(obj: Any, raw: str, argument_keys: Sequence[str]) -> ToolCall | ParseError:
    """A call from a decoded JSON object (flat, or OpenAI's ``{"function": {...}}``)."""
    if isinstance(obj, dict) and isinstance(obj.get("function"), dict):
        obj = obj["function"]
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return ParseError("bad_format", 'a tool call must be a JSON object with a string "name"', raw)
    arguments: Any = {}
    for key in argument_keys:
        if key in obj:
            arguments = obj[key]
            break
    if arguments is None:
        arguments = {}
    if isinstance(arguments, str):  # some models write the arguments as a JSON string
        decoded, _, _ = _json_object(arguments)
        arguments = decoded if isinstance(decoded, dict) else arguments
    if not isinstance(arguments, dict):
        return ParseError(
            "bad_format", f'the "{argument_keys[0]}" of a tool call must be a JSON object', raw, obj["name"]
        )
    return ToolCall(obj["name"], arguments, raw)


_HERMES_OPEN, _HERMES_CLOSE = "<tool_call>", "</tool_call>"


def parse_hermes(text: str) -> ParsedTurn:
    """``<tool_call>`` JSON blocks (Hermes, Qwen 2.5 / 3, posttrain's ChatML tool template)."""
    content, attempts, position = [], [], 0
    while (start := text.find(_HERMES_OPEN, position)) != -1:
        content.append(text[position:start])
        end = text.find(_HERMES_CLOSE, start + len(_HERMES_OPEN))
        if end == -1:
            raw = text[start:]
            attempts.append(ParseError("partial", "the <tool_call> block is not closed with </tool_call>", raw))
            position = len(text)
            break
        raw = text[start : end + len(_HERMES_CLOSE)]
        obj, kind, message = _json_object(text[start + len(_HERMES_OPEN) : end].strip())
        if kind is not None:
            attempts.append(ParseError("invalid_json", f"the <tool_call> block is not valid JSON: {message}", raw))
        else:
            attempts.append(call_from(obj, raw, ("arguments", "parameters")))
        position = end + len(_HERMES_CLOSE)
    content.append(text[position:])
    return ParsedTurn("".join(content).strip(), attempts)


_LLAMA_START = re.compile(r'\{\s*"name"\s*:')
_PYTHON_TAG = "<|python_tag|>"


def parse_llama3(text: str) -> ParsedTurn:
    """Llama 3.1 / 3.2 JSON calls: ``{"name": ..., "parameters": {...}}``, optionally after ``<|python_tag|>``."""
    text = text.replace(_PYTHON_TAG, "")
    decoder = json.JSONDecoder()
    content, attempts, position = [], [], 0
    while (found := _LLAMA_START.search(text, position)) is not None:
        start = found.start()
        content.append(text[position:start])
        try:
            obj, end = decoder.raw_decode(text, start)
        except json.JSONDecodeError as error:
            # Unterminated if the text ran out inside the object; otherwise skip to the next candidate call.
            truncated = error.pos >= len(text.rstrip()) or text.count("{", start) > text.count("}", start)
            kind = "partial" if truncated else "invalid_json"
            following = _LLAMA_START.search(text, start + 1)
            end = following.start() if following and not truncated else len(text)
            attempts.append(
                ParseError(
                    kind,
                    f"the tool call is not valid JSON: {error.msg} at character {error.pos - start}",
                    text[start:end],
                )
            )
            position = end
            continue
        attempts.append(call_from(obj, text[start:end], ("parameters", "arguments")))
        position = end
        separator = re.match(r"\s*;?", text[position:])
        position += separator.end() if separator else 0
    content.append(text[position:])
    return ParsedTurn("".join(content).strip(), attempts)


_MISTRAL_CALLS, _MISTRAL_ARGS = "[TOOL_CALLS]", "[ARGS]"


def parse_mistral(text: str) -> ParsedTurn:
    """Mistral's calls after ``[TOOL_CALLS]``: a JSON list of ``{"name", "arguments"}`` objects (v3), or
    ``NAME[ARGS]{...}`` per call (v11 and later). Needs the text with special tokens."""
    first = text.find(_MISTRAL_CALLS)
    if first == -1:
        return ParsedTurn(_strip_specials(text), [])
    content, attempts = text[:first], []
    decoder = json.JSONDecoder()
    for block in text[first:].split(_MISTRAL_CALLS)[1:]:
        block = block.replace("</s>", "").strip()
        if block.startswith("["):
            try:
                calls, _ = decoder.raw_decode(block)
            except json.JSONDecodeError as error:
                kind = "partial" if error.pos >= len(block) else "invalid_json"
                attempts.append(ParseError(kind, f"the [TOOL_CALLS] list is not valid JSON: {error.msg}", block))
                continue
            calls = calls if isinstance(calls, list) else [calls]
            attempts += [call_from(call, json.dumps(call), ("arguments", "parameters")) for call in calls]
        elif _MISTRAL_ARGS in block:
            name, arguments = block.split(_MISTRAL_ARGS, 1)
            obj, kind, message = _json_object(arguments.strip())
            if kind is not None:
                attempts.append(ParseError(kind, f"the arguments of {name.strip()!r} are not valid JSON: {message}"))
            else:
                attempts.append(call_from({"name": name.strip(), "arguments": obj}, block, ("arguments",)))
        else:
            attempts.append(ParseError("bad_format", "[TOOL_CALLS] is followed by neither a JSON list nor NAME[ARGS]"))
    return ParsedTurn(_strip_specials(content), attempts)


_HARMONY_CALL = re.compile(
    r"to=functions\.(?P<name>[^\s<]+)\s*(?:<\|channel\|>\s*\w*)?\s*(?:<\|constrain\|>\s*\w*)?\s*<\|message\|>"
    r"(?P<arguments>.*?)(?:<\|call\|>|<\|end\|>|$)",
    re.DOTALL,
)
_HARMONY_FINAL = re.compile(r"<\|channel\|>final<\|message\|>(?P<content>.*?)(?:<\|return\|>|<\|end\|>|$)", re.DOTALL)


def parse_gpt_oss(text: str) -> ParsedTurn:
    """gpt-oss (harmony) calls: ``to=functions.NAME ... <|message|>{arguments}<|call|>`` on the commentary channel;
    the content is the final channel's message. Needs the text with special tokens."""
    attempts = []
    for found in _HARMONY_CALL.finditer(text):
        obj, kind, message = _json_object(found["arguments"].strip())
        if kind is not None:
            attempts.append(ParseError(kind, f"the arguments of {found['name']!r} are not valid JSON: {message}"))
        else:
            attempts.append(call_from({"name": found["name"], "arguments": obj}, found.group(0), ("arguments",)))
    final = _HARMONY_FINAL.search(text)
    return ParsedTurn(final["content"].strip() if final else "", attempts)


def _strip_specials(text: str) -> str:
    return re.sub(r"</s>|<\|[a-z_]+\|>|\[/?[A-Z_]+\]", "", text).strip()


_PARSERS: dict[str, Callable[[str], Any]] = {
    "hermes": parse_hermes,
    "qwen": parse_hermes,
    "llama3": parse_llama3,
    "mistral": parse_mistral,
    "gpt-oss": parse_gpt_oss,
}
# Parsers that read the turn with its special tokens (their markers are special tokens of the vocabulary).
WITH_SPECIAL_TOKENS = {"mistral", "gpt-oss"}


def register_parser(name: str, parser: Callable[[str], Any]) -> None:
    """Makes ``parser=name`` use `parser` (``parser(text) -> ParsedTurn | list[ToolCall | dict]``)."""
    if not callable(parser):
        raise ConfigError(f"register_parser({name!r}, ...): the parser must be callable text -> calls.")
    _PARSERS[name] = parser


def get_parser(parser: str | Callable[[str], Any]) -> Callable[[str], Any]:
    """The parser for a registered name, or `parser` itself if it is callable."""
    if callable(parser):
        return parser
    if parser not in _PARSERS:
        raise ConfigError(
            f"Unknown tool-call parser {parser!r}; registered: {sorted(_PARSERS)}. Pass a callable "
            "text -> calls, or register one with posttrain.tools.register_parser(name, fn)."
        )
    return _PARSERS[parser]


def _normalize(output: Any, text: str) -> ParsedTurn:
    """A custom parser's output as a ParsedTurn."""
    if isinstance(output, ParsedTurn):
        return output
    if not isinstance(output, (list, tuple)):
        raise TypeError(f"a tool-call parser must return a ParsedTurn or a list of calls, got {type(output).__name__}")
    attempts = [
        item
        if isinstance(item, (ToolCall, ParseError))
        else call_from(item, json.dumps(item, default=str), ("arguments", "parameters"))
        for item in output
    ]
    return ParsedTurn("" if attempts else text.strip(), attempts)


def json_types(schema: Any) -> list[str]:
    """The JSON types a parameter schema allows (``type`` string or list, ``anyOf``/``oneOf``, ``nullable``)."""
    if not isinstance(schema, dict):
        return []
    declared = schema.get("type")
    types = [declared] if isinstance(declared, str) else list(declared or [])
    for key in ("anyOf", "oneOf"):
        for choice in schema.get(key) or []:
            types += json_types(choice)
    return types + (["null"] if schema.get("nullable") else [])


def _cast(value: str, types: list[str]) -> Any:
    """`value` as the first declared type it reads as; unchanged if none (strings stay strings)."""
    if "string" in types:
        return value
    text = value.strip()
    for kind in types:
        try:
            if kind == "integer":
                number = float(text)
                if number.is_integer():
                    return int(number)
            elif kind == "number":
                number = float(text)
                if number == number and abs(number) != float("inf"):
                    return (
                        int(number) if number.is_integer() and "." not in text and "e" not in text.lower() else number
                    )
            elif kind == "boolean" and text.lower() in ("true", "false", "1", "0"):
                return text.lower() in ("true", "1")
            elif kind == "null" and text in ("null", "None"):
                return None
            elif kind in ("object", "array"):
                decoded = json.loads(text)
                if isinstance(decoded, dict if kind == "object" else list):
                    return decoded
        except ValueError:
            continue
    return value


def parse_tool_calls(
    text: str, parser: str | Callable[[str], Any] = "hermes", tools: Sequence[Callable | dict] | None = None
) -> ParsedTurn:
    """Parses one assistant turn. With `tools`, calls to other names become ``unknown_tool`` errors and string
    arguments are cast to their declared types. Never raises on model output (a custom parser that raises gives a
    ``parser_error``); an unknown parser name raises ConfigError."""
    function = get_parser(parser)
    try:
        turn = _normalize(function(text), text)
    except Exception as error:  # noqa: BLE001 - the model's text must not crash the rollout
        name = getattr(function, "__name__", repr(function))
        return ParsedTurn(
            text.strip(),
            [ParseError("parser_error", f"tool-call parser {name} failed: {type(error).__name__}: {error}", text)],
        )
    return turn if tools is None else check_calls(turn, tools)


def check_calls(turn: ParsedTurn, tools: Sequence[Callable | dict]) -> ParsedTurn:
    """`turn` with calls to names not among `tools` as ``unknown_tool`` errors and string arguments cast to their
    declared types."""
    schemas = {s["function"]["name"]: describe_arguments(s) for s in tool_schemas(tools)}
    attempts: list[ToolCall | ParseError] = []
    for call in turn.attempts:
        if isinstance(call, ParseError):
            attempts.append(call)
        elif call.name not in schemas:
            attempts.append(
                ParseError(
                    "unknown_tool",
                    f"there is no tool named {call.name!r}; available: {sorted(schemas)}",
                    call.raw,
                    call.name,
                )
            )
        else:
            props = schemas[call.name]
            attempts.append(
                ToolCall(
                    call.name,
                    {
                        key: _cast(value, json_types(props[key])) if isinstance(value, str) and key in props else value
                        for key, value in call.arguments.items()
                    },
                    call.raw,
                )
            )
    return ParsedTurn(turn.content, attempts)
