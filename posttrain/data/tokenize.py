"""Tokenization with trained-token masks.

Every example becomes ``input_ids`` plus ``completion_mask`` (1 = the token is a training target).
Masks are computed from character spans of the rendered text and the tokenizer's offsets, so they
work for *any* chat template: an assistant turn's span is found by rendering the conversation up
to it (with the generation prompt) and up to its end; no ``{% generation %}`` markers are needed.
The end-of-turn token that closes an assistant message (``<|im_end|>``, ``<|eot_id|>``, ...) lies
inside the span, so the model learns to stop; whitespace the template adds after it does not.
"""

from __future__ import annotations

import json

from posttrain.data.chat import render, require_chat_template
from posttrain.data.formats import DatasetFormat
from posttrain.errors import DataError

Span = tuple[int, int]


def tokenize_with_spans(tokenizer, text: str, spans: list[Span] | None, add_special_tokens: bool) -> tuple[list, list]:
    """Token ids of `text` and a 0/1 mask: 1 where the token holds a character of one of `spans` (None = all).

    A token that straddles a span's start is trained: byte-level BPE attaches a space to the word after
    it, so for the prompt "the sky is " and the completion "blue" the token " blue" carries the answer.
    """
    if not getattr(tokenizer, "is_fast", False):
        raise DataError(
            "posttrain needs a fast tokenizer (it maps trained characters to tokens through offsets). "
            "Load it with AutoTokenizer.from_pretrained(..., use_fast=True)."
        )
    enc = tokenizer(text, add_special_tokens=add_special_tokens, return_offsets_mapping=True)
    ids = enc["input_ids"]
    if spans is None:
        return ids, [1] * len(ids)
    mask = []
    for start, end in enc["offset_mapping"]:
        inside = any(start < e and end > s for s, e in spans)
        mask.append(int(inside))
    return ids, mask


def _content_text(content) -> str:
    """A message's text: its string content, or the text of its typed blocks (multimodal messages)."""
    if isinstance(content, str):
        return content
    return "".join(part.get("text", "") for part in content or [] if part.get("type") == "text")


def assistant_spans(tokenizer, messages: list[dict], row: int = 0, **template_kwargs) -> tuple[str, list[Span]]:
    """The rendered conversation and the character span of each assistant turn (content + end-of-turn)."""
    text = render(tokenizer, messages, **template_kwargs)
    spans, cursor = [], 0
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        before = render(tokenizer, messages[:i], add_generation_prompt=True, **template_kwargs) if i else None
        if before is not None and text.startswith(before) and len(before) >= cursor:
            start = len(before)
            upto = render(tokenizer, messages[: i + 1], **template_kwargs)
            if upto.startswith(before) and text.startswith(upto):
                spans.append((start, len(upto.rstrip())))
                cursor = spans[-1][1]
                continue
        else:
            start = text.find(_content_text(message["content"]), cursor)
            if start < 0:
                raise DataError(
                    f"Row {row}: the chat template does not reproduce assistant message {i} verbatim, so its "
                    "tokens cannot be located for assistant_only_loss. Use a template that renders assistant "
                    "content as is, or set assistant_only_loss=False."
                )
        # The template renders this turn differently inside the whole conversation (e.g. it drops
        # earlier reasoning): the turn runs from its start to the first end-of-turn token.
        eos = tokenizer.eos_token
        stop = text.find(eos, start) if eos else -1
        span = (start, stop + len(eos)) if stop >= 0 else (start, start + len(_content_text(message["content"])))
        spans.append(span)
        cursor = span[1]
    return text, spans


def row_template_kwargs(example: dict, row: int = 0) -> dict:
    """A row's own `tools` (a list of JSON schemas, or their JSON text as datasets often store them) and
    `chat_template_kwargs`, for its chat template, as TRL reads them."""
    out = dict(example.get("chat_template_kwargs") or {})
    tools = example.get("tools")
    if isinstance(tools, str):
        try:
            tools = json.loads(tools)
        except json.JSONDecodeError as error:
            raise DataError(
                f"Row {row}, column 'tools': not valid JSON ({error}); give a list of tool schemas."
            ) from error
    if tools:
        out["tools"] = tools
    return out


def tokenize_example(
    example: dict,
    tokenizer,
    fmt: DatasetFormat,
    *,
    row: int = 0,
    max_length: int | None = None,
    completion_only_loss: bool = True,
    assistant_only_loss: bool = False,
    add_eos: bool = True,
    template_kwargs: dict | None = None,
    truncation_mode: str = "keep_start",
) -> dict[str, list[int]]:
    """`input_ids` and `completion_mask` for one language-modeling or prompt-completion example."""
    kw = template_kwargs or {}
    if fmt.conversational:
        kw = {**kw, **row_template_kwargs(example, row)}
        require_chat_template(tokenizer)
        if fmt.kind == "language_modeling":
            messages, prompt_len = example["messages"], 0
        else:
            messages = list(example["prompt"]) + list(example["completion"])
            prompt_len = len(example["prompt"])
        if assistant_only_loss:
            text, spans = assistant_spans(tokenizer, messages, row=row, **kw)
            if prompt_len and completion_only_loss:
                prompt_text = render(tokenizer, messages[:prompt_len], add_generation_prompt=True, **kw)
                spans = [(max(s, len(prompt_text)), e) for s, e in spans if e > len(prompt_text)]
        elif prompt_len and completion_only_loss:
            prompt_text = render(tokenizer, messages[:prompt_len], add_generation_prompt=True, **kw)
            text = render(tokenizer, messages, **kw)
            if not text.startswith(prompt_text):
                raise DataError(
                    f"Row {row}: the rendered prompt is not a prefix of the rendered conversation; "
                    "cannot tell the completion apart. Check the chat template."
                )
            spans = [(len(prompt_text), len(text.rstrip()))]
        else:
            text, spans = render(tokenizer, messages, **kw), None
        ids, mask = tokenize_with_spans(tokenizer, text, spans, add_special_tokens=False)
    else:
        if fmt.kind == "language_modeling":
            text, spans = example["text"], None
        else:
            text = example["prompt"] + example["completion"]
            spans = [(len(example["prompt"]), len(text))] if completion_only_loss else None
        ids, mask = tokenize_with_spans(tokenizer, text, spans, add_special_tokens=True)
        eos = tokenizer.eos_token_id
        if add_eos and eos is not None and (not ids or ids[-1] != eos):
            ids, mask = ids + [eos], mask + [1]
    if not any(mask):
        raise DataError(
            f"Row {row} has no tokens to train on (the whole example is masked: e.g. an empty completion, or no "
            "assistant turn with assistant_only_loss). Fix or drop the row."
        )
    ids, mask = truncate(ids, mask, max_length, truncation_mode, row)
    return {"input_ids": ids, "completion_mask": mask}


def truncate(
    ids: list, mask: list, max_length: int | None, truncation_mode: str = "keep_start", row: int = 0, untrained: int = 0
):
    """The first (``keep_start``) or last (``keep_end``) `max_length` tokens and their mask (or labels, with
    ``untrained=-100``); a row left with no trained token is an error (it would add nothing to the loss)."""
    if max_length is None or len(ids) <= max_length:
        return ids, mask
    cut = slice(None, max_length) if truncation_mode == "keep_start" else slice(len(ids) - max_length, None)
    ids, mask = ids[cut], mask[cut]
    if all(m == untrained for m in mask):
        where = "beyond" if truncation_mode == "keep_start" else "before the last"
        raise DataError(
            f"Row {row}: all its trained tokens lie {where} max_length={max_length} (truncation_mode="
            f"{truncation_mode!r}). Raise max_length, shorten the prompt, or drop the row."
        )
    return ids, mask
