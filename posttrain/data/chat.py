"""Chat helpers with the names TRL users know: render conversations, convert ShareGPT rows,
make implicit prompts explicit, unpair preference data."""

from __future__ import annotations

from typing import Any

from posttrain.data.formats import TEXT_COLUMNS, is_conversational, is_message_list
from posttrain.errors import DataError

SHAREGPT_ROLES = {
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "system": "system",
    "tool": "tool",
    "function_call": "assistant",
    "observation": "tool",
}


def convert_sharegpt(messages: list[dict]) -> list[dict]:
    """Converts ShareGPT messages to the role/content messages the trainers read: `from`/`value` ->
    `role`/`content`, `human`/`gpt` -> user/assistant.

    See docs/dataset_formats.md.
    """
    converted = []
    for m in messages:
        if "from" in m:
            role = SHAREGPT_ROLES.get(m["from"], m["from"])
            converted.append({"role": role, "content": m.get("value", m.get("content"))})
        else:
            converted.append(m)
    return converted


def normalize_example(example: dict) -> dict:
    """Returns `example` with ShareGPT-style conversations converted to role/content."""
    out = dict(example)
    for col in TEXT_COLUMNS:
        value = out.get(col)
        if is_message_list(value) and any("from" in m for m in value):
            out[col] = convert_sharegpt(value)
        elif col == "completions" and isinstance(value, list) and value and all(is_message_list(v) for v in value):
            out[col] = [convert_sharegpt(v) for v in value]
    return out


def require_chat_template(tokenizer, what: str = "conversational data") -> None:
    if getattr(tokenizer, "chat_template", None) is None:
        raise DataError(
            f"The tokenizer has no chat template, which {what} needs to be rendered. Set one "
            "(tokenizer.chat_template = '...'), use a tokenizer that has one (e.g. an instruct model's), "
            "or give the data in standard (string) form."
        )


def render(tokenizer, messages: list[dict], add_generation_prompt: bool = False, **template_kwargs) -> str:
    """The chat template applied to `messages`, as text."""
    return tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=add_generation_prompt, **template_kwargs
    )


# The column sets `apply_chat_template` accepts (besides `label`), one per dataset format.
TEMPLATE_KEY_SETS = (
    {"messages"},
    {"prompt"},
    {"prompt", "completion"},
    {"prompt", "chosen", "rejected"},
    {"chosen", "rejected"},
    {"prompt", "completion", "label"},
)


def _common_prefix(text: str, other: str) -> str:
    n = 0
    for a, b in zip(text, other):
        if a != b:
            break
        n += 1
    return text[:n]


def apply_chat_template(
    example: dict, processing_class, tools: list | None = None, **template_kwargs
) -> dict[str, str]:
    """Turns a conversational row into text with the tokenizer's chat template, keeping its dataset format
    (TRL's function).

    `messages` -> `text`; `prompt` -> `prompt` (a generation prompt after a user/tool turn, the last message
    continued after an assistant turn); `completion`/`chosen`/`rejected` -> the text that follows the prompt.
    The prompt is cut to what the prompt-plus-completion renderings share, because some templates render a
    lone prompt differently (e.g. a thinking block). A row's own ``chat_template_kwargs`` are passed on.
    ShareGPT (``from``/``value``) messages are converted first.

    See docs/dataset_formats.md.
    """
    keys = {k for k in example if k in ("prompt", "chosen", "rejected", "completion", "messages", "label")}
    if keys not in TEMPLATE_KEY_SETS:
        raise KeyError(
            f"Invalid keys in the example: {sorted(keys)}. apply_chat_template renders one dataset format: "
            f"{[sorted(k) for k in TEMPLATE_KEY_SETS]}; rename or drop the other columns."
        )
    tokenizer = processing_class
    require_chat_template(tokenizer)
    kwargs = {"tools": tools or None, **(example.get("chat_template_kwargs") or {}), **template_kwargs}
    example = normalize_example(example)
    out: dict[str, Any] = {}
    if "messages" in example:
        out["text"] = render(tokenizer, example["messages"], **kwargs)
    if "prompt" in example:
        prompt = example["prompt"]
        last_role = prompt[-1]["role"]
        if last_role not in ("user", "tool", "assistant"):
            raise ValueError(
                f"Invalid role in the last message of the prompt: {last_role!r}; a prompt ends with a "
                "user or tool turn (answered) or an assistant turn (continued)."
            )
        text = render(
            tokenizer,
            prompt,
            add_generation_prompt=last_role != "assistant",
            continue_final_message=last_role == "assistant",
            **kwargs,
        )
        full = {
            col: render(tokenizer, prompt + example[col], **kwargs)
            for col in ("chosen", "rejected", "completion")
            if col in example
        }
        for rendered in full.values():
            text = _common_prefix(text, rendered)
        out["prompt"] = text
        for col, rendered in full.items():
            out[col] = rendered[len(text) :]
    else:
        for col in ("chosen", "rejected"):
            if col in example:
                out[col] = render(tokenizer, example[col], **kwargs)
    if "label" in example:
        out["label"] = example["label"]
    return {k: out[k] for k in ("text", "prompt", "chosen", "rejected", "completion", "label") if k in out}


def maybe_apply_chat_template(example: dict, processing_class, tools: list | None = None, **template_kwargs) -> dict:
    """`apply_chat_template` for conversational examples; standard examples are returned unchanged.

    See docs/dataset_formats.md.
    """
    if is_conversational(example):
        return apply_chat_template(example, processing_class, tools=tools, **template_kwargs)
    return example


def extract_prompt(example: dict) -> dict:
    """Implicit prompt -> explicit, trainer side: the shared start of `chosen` and `rejected` becomes `prompt`.

    Conversational rows split at the last message the two share; string rows at the longest common
    prefix, backed up to the last whitespace so that no word is cut (the prompt keeps the space). TRL's
    rule, which gives the space to the completions, is `posttrain.data.transforms.extract_prompt`.
    """
    chosen, rejected = example["chosen"], example["rejected"]
    if isinstance(chosen, list):
        n = 0
        while n < min(len(chosen), len(rejected)) - 1 and chosen[n] == rejected[n]:
            n += 1
        return {**example, "prompt": chosen[:n], "chosen": chosen[n:], "rejected": rejected[n:]}
    n = 0
    while n < min(len(chosen), len(rejected)) and chosen[n] == rejected[n]:
        n += 1
    while n > 0 and not chosen[n - 1].isspace():
        n -= 1
    return {**example, "prompt": chosen[:n], "chosen": chosen[n:], "rejected": rejected[n:]}


def unpair_preference_dataset(dataset, num_proc: int | None = None):
    """Paired preference rows -> unpaired rows (`prompt`, `completion`, `label`), two per pair, trainer side:
    each pair's rows stay adjacent and an implicit prompt is made explicit. TRL's function (chosen rows of a
    batch first, no prompt extraction) is `posttrain.data.transforms.unpair_preference_dataset`."""

    def unpair(batch):
        n = len(batch["chosen"])
        prompts = batch["prompt"] if "prompt" in batch else [None] * n
        out = {"prompt": [], "completion": [], "label": []}
        for prompt, chosen, rejected in zip(prompts, batch["chosen"], batch["rejected"]):
            if prompt is None:
                explicit = extract_prompt({"chosen": chosen, "rejected": rejected})
                prompt, chosen, rejected = explicit["prompt"], explicit["chosen"], explicit["rejected"]
            out["prompt"] += [prompt, prompt]
            out["completion"] += [chosen, rejected]
            out["label"] += [True, False]
        return out

    return dataset.map(unpair, batched=True, remove_columns=dataset.column_names, num_proc=num_proc)
