"""TRL's `trl.chat_template_utils` import path; the chat-template tools live in `posttrain.data.chat_templates`,
response parsing in `posttrain.data.responses` (parsers in `posttrain.data.response_templates`)."""

from posttrain.data.chat_templates import (
    add_response_schema,
    chatml_turns,
    clone_chat_template,
    get_training_chat_template,
    has_generation_markers,
    is_chat_template_prefix_preserving,
    supports_tool_calling,
)
from posttrain.data.response_templates import HERMES_RESPONSE_TEMPLATE, LLAMA3_RESPONSE_TEMPLATE
from posttrain.data.responses import is_chat_template_stop_token_trained, parse_response

__all__ = [
    "HERMES_RESPONSE_TEMPLATE",
    "LLAMA3_RESPONSE_TEMPLATE",
    "add_response_schema",
    "chatml_turns",
    "clone_chat_template",
    "get_training_chat_template",
    "has_generation_markers",
    "is_chat_template_prefix_preserving",
    "is_chat_template_stop_token_trained",
    "parse_response",
    "supports_tool_calling",
]
