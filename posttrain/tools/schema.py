"""Tool descriptions: JSON schemas from Python signatures, and the check that a chat template can show them.

The schema comes from transformers' `get_json_schema` (the same conversion `apply_chat_template(tools=...)` does),
so what the model is shown and what posttrain validates arguments against are one and the same. Problems surface as
`ConfigError` naming the function, before any training step.
"""

from __future__ import annotations

import inspect
import json
from collections.abc import Callable, Sequence
from typing import Any

from jinja2 import TemplateError
from transformers.utils import get_json_schema
from transformers.utils.chat_template_utils import DocstringParsingException, TypeHintParsingException

from posttrain.errors import ConfigError

_DOCSTRING_EXAMPLE = (
    'def add(a: int, b: int) -> int:\n    """Adds two integers.\n\n    Args:\n        a: The first integer.\n'
    '        b: The second integer.\n    """'
)


def tool_name(tool: Callable | dict) -> str:
    """The name the model calls `tool` by (a function's ``__name__``, a schema's ``function.name``)."""
    if isinstance(tool, dict):
        return tool.get("function", tool)["name"]
    return tool.__name__


def tool_schema(tool: Callable | dict) -> dict:
    """The ``{"type": "function", "function": {...}}`` schema of a tool, as `apply_chat_template` renders it.

    A dict is taken as an already written schema. A callable must be a plain function or a bound method (what
    `apply_chat_template` accepts) with a type hint on every argument and a Google-style docstring describing each.
    """
    if isinstance(tool, dict):
        function = tool.get("function", tool)
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise ConfigError(
                f"Tool schema {tool!r} has no function name: give {{'type': 'function', 'function': "
                "{'name': ..., 'description': ..., 'parameters': {...}}}."
            )
        return tool if "function" in tool else {"type": "function", "function": tool}
    name = getattr(tool, "__qualname__", None) or repr(tool)
    if not (inspect.isfunction(tool) or inspect.ismethod(tool)):
        raise ConfigError(
            f"Tool {name} is a {type(tool).__name__}, not a function or a bound method: chat templates describe tools "
            "from a function's signature and docstring. Wrap it in a `def` with typed arguments and a docstring."
        )
    try:
        return get_json_schema(tool)
    except (DocstringParsingException, TypeHintParsingException) as error:
        raise ConfigError(
            f"Tool {name} cannot be described to the model: {error}. Every argument needs a type hint (int, float, "
            f"str, bool, list[...], dict, Literal[...], Optional[...]) and a line under `Args:` in a Google-style "
            f"docstring, e.g.\n{_DOCSTRING_EXAMPLE}"
        ) from error


def tool_schemas(tools: Sequence[Callable | dict]) -> list[dict]:
    """Schemas of all `tools`, refusing two tools with the same name (the model could not tell them apart)."""
    schemas = [tool_schema(tool) for tool in tools]
    seen: dict[str, int] = {}
    for index, schema in enumerate(schemas):
        name = schema["function"]["name"]
        if name in seen:
            raise ConfigError(
                f"Tools {seen[name]} and {index} are both named {name!r}; the model calls tools by "
                "name, so give each a distinct function name."
            )
        seen[name] = index
    return schemas


# Distinct strings, so the rendered text shows which part of the exchange a template kept.
_ARG_KEY, _ARG_VALUE, _RESULT = "probe_argument_5d1c", "probe_value_8e2a", "probe_result_3f7b"

_FIX = (
    "Give the model a chat template that renders tool calls before training, e.g. posttrain's ChatML one (same "
    "<|im_start|>/<|im_end|> tokens as SmolLM2 and Qwen2.5): `tokenizer.chat_template = "
    "posttrain.tools.chatml_tool_template()` (or `posttrain.tools.use_chatml_tool_template(tokenizer)`), or save it "
    "to a .jinja file and pass `chat_template_path=...`, or copy a tool-calling model's template with "
    "`posttrain.data.chat_templates.clone_chat_template`."
)


def _render(tokenizer, messages: list[dict], tools: list[dict], chat_template: str | None, **kwargs) -> str:
    return tokenizer.apply_chat_template(messages, tools=tools, chat_template=chat_template, tokenize=False, **kwargs)


def check_template_renders_tools(tokenizer, tools: Sequence[Callable | dict], chat_template: str | None = None) -> None:
    """Raises ConfigError unless the chat template renders a whole tool exchange with these tools.

    Renders (1) the prompt with `tools=`, which must list every tool's name, and (2) user -> assistant calling the
    first tool -> tool result, where the call's arguments and the result must appear. Templates that fail on the
    tool role or silently drop the tool list, the calls or the results (SmolLM2's, plain Llama 3) are refused.
    `chat_template` overrides the tokenizer's own, as in `apply_chat_template`.
    """
    schemas = tool_schemas(tools)
    if not schemas:
        return
    template_name = "the given chat template" if chat_template is not None else "the tokenizer's chat template"
    if chat_template is None and getattr(tokenizer, "chat_template", None) is None:
        raise ConfigError(f"The tokenizer has no chat template, so it cannot show the model its tools. {_FIX}")
    name = schemas[0]["function"]["name"]
    user = [{"role": "user", "content": "hi"}]
    try:
        prompt = _render(tokenizer, user, schemas, chat_template, add_generation_prompt=True)
        rendered = None
        for arguments in ({_ARG_KEY: _ARG_VALUE}, json.dumps({_ARG_KEY: _ARG_VALUE})):
            call = {"type": "function", "function": {"name": name, "arguments": arguments}}
            exchange = user + [
                {"role": "assistant", "content": "", "tool_calls": [call]},
                {"role": "tool", "name": name, "content": _RESULT},
            ]
            try:
                rendered = _render(tokenizer, exchange, schemas, chat_template)
                break
            except TypeError:  # some templates only take JSON-string arguments
                continue
    except (TemplateError, TypeError, ValueError) as error:
        raise ConfigError(
            f"{template_name} cannot render a tool-calling conversation ({type(error).__name__}: {error}). {_FIX}"
        ) from error
    if rendered is None:
        raise ConfigError(f"{template_name} rejects tool-call arguments both as a dict and as a JSON string. {_FIX}")
    missing = [
        what
        for what, present in (
            ("the tool list (tools=...) in the prompt", all(s["function"]["name"] in prompt for s in schemas)),
            ("the assistant's tool call", _ARG_KEY in rendered and _ARG_VALUE in rendered),
            ("the tool result message", _RESULT in rendered),
        )
        if not present
    ]
    if missing:
        raise ConfigError(
            f"{template_name} does not render {', '.join(missing)}, so the model could neither see its "
            f"tools nor learn from calling them. {_FIX}"
        )


def describe_arguments(schema: dict) -> dict[str, Any]:
    """``{argument: JSON-schema}`` of a tool schema's parameters (empty for a tool without arguments)."""
    parameters = schema.get("function", schema).get("parameters") or {}
    properties = parameters.get("properties") if isinstance(parameters, dict) else None
    return properties if isinstance(properties, dict) else {}
