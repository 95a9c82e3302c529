"""The token ids of a tool turn, to append after the model's own ids without re-tokenising them.

The ids come from the chat template itself: a short conversation ending with an assistant tool call is rendered
alone and then followed by the tool messages and the next assistant header; the difference is what the template
puts between the model's end-of-turn token and its next reply. The model's sampled ids are never decoded; only
this suffix is tokenised. Same rule as TRL 1.16: the cut is after the last EOS of the short rendering, so text a
template writes after EOS (ChatML's newline) belongs to the tool turn.
"""

from __future__ import annotations

from collections.abc import Sequence

from posttrain.errors import ConfigError


def _ids(
    processing_class, messages: list[dict], chat_template: str | None, generation_prompt: bool, template_kwargs: dict
) -> list[int]:
    out = processing_class.apply_chat_template(
        messages,
        chat_template=chat_template,
        tokenize=True,
        return_dict=False,
        add_generation_prompt=generation_prompt,
        **template_kwargs,
    )
    return list(out[0]) if out and isinstance(out[0], list) else list(out)


def tool_suffix_ids(
    processing_class, tool_messages: Sequence[dict], chat_template: str | None = None, **template_kwargs
) -> list[int]:
    """Ids of `tool_messages` (``{"role": "tool", "name", "content"}``) plus the next assistant header, as the
    template renders them after an assistant turn that ended with its EOS token."""
    if not tool_messages:
        raise ValueError("tool_suffix_ids needs at least one tool message.")
    tokenizer = getattr(processing_class, "tokenizer", processing_class)
    call = {"type": "function", "function": {"name": tool_messages[0].get("name", "tool"), "arguments": {}}}
    head = [{"role": "user", "content": "x"}, {"role": "assistant", "content": "", "tool_calls": [call]}]
    short = _ids(processing_class, head, chat_template, False, template_kwargs)
    full = _ids(processing_class, head + list(tool_messages), chat_template, True, template_kwargs)
    ends = [i for i, token in enumerate(short) if token == tokenizer.eos_token_id]
    if ends:
        short = short[: ends[-1] + 1]
    if full[: len(short)] != short:
        raise ConfigError(
            "The chat template renders an assistant turn differently once tool results follow it, so tool results "
            "cannot be appended to the sampled ids. Use a prefix-preserving template: "
            "`posttrain.data.chat_templates.get_training_chat_template(tokenizer)` or posttrain.tools' ChatML one."
        )
    return full[len(short) :]
