"""Small clean-ups of dataset rows: dropping the None values a column union leaves behind, and the image objects
of a conversation before it is logged."""

from __future__ import annotations

from collections.abc import Mapping


def remove_none_values(example):
    """`example` (a dict or list, nested) without the keys whose value is None (the holes `Dataset.from_list`
    fills when rows have different keys), at every depth; list items themselves are kept, None included."""
    if isinstance(example, Mapping):
        return {k: remove_none_values(v) for k, v in example.items() if v is not None}
    if isinstance(example, list):
        return [remove_none_values(v) for v in example]
    return example


def strip_images_from_messages(messages):
    """A conversation whose `{"type": "image", "image": <image>}` blocks lose their image object (`{"type":
    "image"}`), so it can be logged or serialized; string contents and anything not a list are returned as given."""
    if not isinstance(messages, list):
        return messages
    stripped = []
    for message in messages:
        content = message.get("content") if isinstance(message, Mapping) else None
        if isinstance(content, list):
            blocks = [
                {k: v for k, v in block.items() if k != "image"} if block.get("type") == "image" else block
                for block in content
            ]
            message = {**message, "content": blocks}
        stripped.append(message)
    return stripped


__all__ = ["remove_none_values", "strip_images_from_messages"]
