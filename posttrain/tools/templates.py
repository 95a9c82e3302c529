"""A ChatML chat template that can render tool calls, for models whose own template cannot (SmolLM2's).

It uses only ChatML's two special tokens (``<|im_start|>``, ``<|im_end|>``), so it fits SmolLM2's and Qwen's
tokenizers without new embeddings. Tools are listed in the system turn as JSON inside ``<tools>``; the assistant
calls them with Hermes-style ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks (what the
"hermes" parser reads, and what `posttrain.data.chat_templates.add_response_schema` recognises); tool results come
back as ``<tool_response>`` blocks in one user turn, as in Qwen 2.5. Without tools it renders exactly like plain
ChatML with the given default system prompt (SmolLM2's by default), so switching to it changes no other prompt.

Each assistant turn is wrapped in ``{% generation %}`` and earlier turns render the same whatever follows, so the
template is already fit for assistant-only training and multi-turn tool rollouts (`get_training_chat_template`
returns None for it).
"""

from __future__ import annotations

import json

from posttrain.data.chat_templates import add_response_schema, chatml_turns

SMOLLM2_DEFAULT_SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"

_TOOLS_INTRO = (
    "\n\n# Tools\n\nYou may call one or more of the functions below to help with the request. Each function's "
    "signature is given as JSON inside <tools></tools>:\n<tools>"
)
_TOOLS_OUTRO = (
    "\n</tools>\n\nTo call a function, write a JSON object with its name and arguments between <tool_call> and "
    '</tool_call> tags, one block per call:\n<tool_call>\n{"name": <function-name>, "arguments": '
    "<arguments-as-a-JSON-object>}\n</tool_call>"
)


def chatml_tool_template(default_system: str | None = SMOLLM2_DEFAULT_SYSTEM) -> str:
    """The Jinja source of the ChatML tool-calling template.

    `default_system` is the system text used when the conversation has no system turn (None: no system turn then,
    unless tools are given, which always open a system turn).
    """
    default = "none" if default_system is None else json.dumps(default_system)
    return (
        "{%- set has_system = messages and messages[0]['role'] == 'system' %}"
        "{%- set system_text = messages[0]['content'] if has_system else " + default + " %}"
        "{%- if tools %}"
        "{{- '<|im_start|>system\\n' + (system_text or '') + " + json.dumps(_TOOLS_INTRO) + " }}"
        "{%- for tool in tools %}{{- '\\n' + (tool | tojson) }}{%- endfor %}"
        "{{- " + json.dumps(_TOOLS_OUTRO) + " + '<|im_end|>\\n' }}"
        "{%- elif system_text is not none %}"
        "{{- '<|im_start|>system\\n' + system_text + '<|im_end|>\\n' }}"
        "{%- endif %}"
    ) + chatml_turns(newline_in_generation=False)


CHATML_TOOL_TEMPLATE = chatml_tool_template()


def use_chatml_tool_template(processing_class, default_system: str | None = SMOLLM2_DEFAULT_SYSTEM):
    """Gives a ChatML tokenizer (or a processor's) the tool-calling template and the matching response parser
    (``response_template``, read by ``tokenizer.parse_response``). Returns the same object."""
    tokenizer = getattr(processing_class, "tokenizer", processing_class)
    missing = [t for t in ("<|im_start|>", "<|im_end|>") if t not in tokenizer.get_vocab()]
    if missing:
        from posttrain.errors import ConfigError

        raise ConfigError(
            f"The ChatML tool template needs the tokens {missing}, which this tokenizer lacks; use a "
            "template written for its own special tokens (or clone one with clone_chat_template)."
        )
    processing_class.chat_template = chatml_tool_template(default_system)
    if processing_class is not tokenizer:
        tokenizer.chat_template = processing_class.chat_template
    return add_response_schema(processing_class)
