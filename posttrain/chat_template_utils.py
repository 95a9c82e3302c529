"""TRL's `trl.chat_template_utils` import path; the chat-template tools live in `posttrain.data.chat_templates`."""

from posttrain.data.chat_templates import (
    HERMES_RESPONSE_TEMPLATE,
    LLAMA3_RESPONSE_TEMPLATE,
    add_response_schema,
    chatml_turns,
    clone_chat_template,
    get_training_chat_template,
    has_generation_markers,
    is_chat_template_prefix_preserving,
    supports_tool_calling,
)

__all__ = [
    "HERMES_RESPONSE_TEMPLATE",
    "LLAMA3_RESPONSE_TEMPLATE",
    "add_response_schema",
    "chatml_turns",
    "clone_chat_template",
    "get_training_chat_template",
    "has_generation_markers",
    "is_chat_template_prefix_preserving",
    "supports_tool_calling",
]
