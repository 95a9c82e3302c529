"""Conversions between TRL-style conversations / log-probs and the OpenAI-compatible HTTP API of a vLLM server:
images inlined as PNG data URLs, and per-position top log-probs read back as token ids."""

from __future__ import annotations

import base64
import copy
import io
import math

_IMAGE_KEYS = {"image": "image", "image_pil": "image_pil"}


def pil_to_base64(image) -> str:
    """`image` (a PIL image) as base64-encoded PNG bytes."""
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return base64.b64encode(buffer.getvalue()).decode("utf-8")


def to_openai_messages(messages: list[dict]) -> list[dict]:
    """A copy of `messages` whose image parts (`{"type": "image", "image": <PIL>}` or `{"type": "image_pil", ...}`)
    are `{"type": "image_url", "image_url": {"url": "data:image/png;base64,..."}}`; other parts are unchanged."""
    messages = copy.deepcopy(messages)
    for message in messages:
        if not isinstance(message.get("content"), list):
            continue
        message["content"] = [
            {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{pil_to_base64(part[part['type']])}"}}
            if isinstance(part, dict) and part.get("type") in _IMAGE_KEYS
            else part
            for part in message["content"]
        ]
    return messages


def _token_id(token: str) -> int:
    return int(token.removeprefix("token_id:"))


def parse_logprobs(choices_logprobs: list[dict | None]) -> tuple[list | None, list | None]:
    """(log-probs, token ids), each [sequence][position][candidate], from the `logprobs` of each choice of a
    completions (`tokens` / `token_logprobs` / `top_logprobs`) or chat-completions (`content`) answer whose tokens
    are `"token_id:<id>"` strings. Each position lists the sampled token and the top candidates, most probable first;
    a NaN log-prob is None. (None, None) when the server returned no log-probs."""
    if not choices_logprobs or choices_logprobs[0] is None:
        return None, None
    all_logps, all_ids = [], []
    for logprobs in choices_logprobs:
        if "content" in logprobs:
            positions = [
                (e["token"], e["logprob"], {t["token"]: t["logprob"] for t in e.get("top_logprobs") or []})
                for e in logprobs["content"]
            ]
        else:
            positions = zip(logprobs["tokens"], logprobs["token_logprobs"], logprobs["top_logprobs"], strict=True)
        seq_logps, seq_ids = [], []
        for token, logp, top in positions:
            ranked = sorted({token: logp, **(top or {})}.items(), key=lambda item: -item[1])
            seq_ids.append([_token_id(t) for t, _ in ranked])
            seq_logps.append([None if math.isnan(v) else v for _, v in ranked])
        all_logps.append(seq_logps)
        all_ids.append(seq_ids)
    return all_logps, all_ids


__all__ = ["parse_logprobs", "pil_to_base64", "to_openai_messages"]
