"""Row and dataset transforms with TRL's names and behaviour (the public `posttrain.data_utils` face):
ShareGPT -> ChatML, multimodal message blocks, implicit -> explicit prompts, paired -> unpaired preferences.

Two differ from the trainer-side helpers of the same name in `posttrain.data.chat`: `extract_prompt`
(TRL gives a string prompt's trailing space to the completions) and `unpair_preference_dataset` (TRL puts
a map batch's chosen rows first, then its rejected ones, and does not extract implicit prompts).
"""

from __future__ import annotations

from typing import Any

from posttrain.data.formats import is_conversational
from posttrain.errors import DataError

ROLES = ("system", "user", "assistant", "tool")


def prepare_multimodal_messages(messages: list[dict[str, Any]], images: list | None = None) -> list[dict[str, Any]]:
    """Puts conversations with images into the content-part form vision-language processors expect.

    Messages with every string ``content`` turned into ``[{"type": "text", "text": ...}]`` blocks and one
    ``{"type": "image"}`` block per image placed before the first user message's text; every image block
    without an ``image`` payload then receives the next image. Raises ValueError on an unknown role or when
    the images do not match the empty image blocks one for one. The input messages are not modified.

    See docs/vision.md.
    """
    images = list(images or [])
    out, images_placed = [], False
    for message in messages:
        role = message["role"]
        if role not in ROLES:
            raise ValueError(f"Invalid role in message: {role!r}. Expected one of {ROLES}.")
        content = message.get("content")
        if isinstance(content, str):
            blocks = [{"type": "text", "text": content}]
            if role == "user" and not images_placed:
                blocks = [{"type": "image"} for _ in images] + blocks
                images_placed = True
            message = {**message, "content": blocks}
        out.append(message)

    # Tool results never carry images; assistant turns made only of tool calls have no content.
    slots = [
        (i, j)
        for i, m in enumerate(out)
        if m.get("content") and m["role"] != "tool"
        for j, part in enumerate(m["content"])
        if part["type"] == "image" and "image" not in part
    ]
    if len(slots) != len(images):
        raise ValueError(
            f"Number of images provided ({len(images)}) does not match number of image placeholders "
            f"({len(slots)}). Give one image per {{'type': 'image'}} block without an 'image' payload."
        )
    for (i, j), image in zip(slots, images):
        content = list(out[i]["content"])
        content[j] = {**content[j], "image": image}
        out[i] = {**out[i], "content": content}
    return out


def is_conversational_from_value(example: dict[str, Any]) -> bool:
    """Tells whether a row holds ShareGPT-style messages, to convert before training.

    True if the ``conversations`` column holds ShareGPT messages (``from``/``value`` keys).

    See docs/dataset_formats.md.
    """
    messages = example.get("conversations")
    return (
        isinstance(messages, list)
        and len(messages) > 0
        and isinstance(messages[0], dict)
        and "from" in messages[0]
        and "value" in messages[0]
    )


def maybe_convert_to_chatml(example: dict[str, list]) -> dict[str, list]:
    """Converts a row's ShareGPT messages (`from`/`value`) to the role/content messages the trainers read.

    ShareGPT -> ChatML: in every message list, ``from`` becomes ``role`` and ``value`` becomes ``content``
    (role names are kept as they are), and a ``conversations`` column becomes ``messages``. Like TRL, the
    messages are renamed in place and the same example is returned.

    See docs/dataset_formats.md.
    """
    for key in ("prompt", "completion", "chosen", "rejected", "messages", "conversations"):
        if isinstance(example.get(key), list):
            for message in example[key]:
                if isinstance(message, dict):
                    if "from" in message:
                        message["role"] = message.pop("from")
                    if "value" in message:
                        message["content"] = message.pop("value")
    if "conversations" in example:
        example["messages"] = example.pop("conversations")
    return example


def extract_prompt(example: dict) -> dict:
    """Makes an implicit prompt explicit in a preference row.

    Implicit prompt -> explicit: the shared start of `chosen` and `rejected` becomes `prompt` (TRL's rule;
    the trainers use their own split, which keeps the space in the prompt).

    The split is at the first item (message, or character for strings) where the two differ; a string
    prompt gives its trailing space to the completions (``"The sky is"`` + ``" blue."``). If one is a
    prefix of the other, the split is one item before the shorter one's end, so each keeps a last item.
    Only ``prompt``, ``chosen`` and ``rejected`` are returned.

    See docs/dataset_formats.md.
    """
    chosen, rejected = example["chosen"], example["rejected"]
    shortest = min(len(chosen), len(rejected))
    if shortest == 0:
        raise DataError(
            "extract_prompt: 'chosen' or 'rejected' is empty, so there is no shared prompt to find. "
            "Fix or drop the row."
        )
    idx = shortest - 1
    for i in range(shortest):
        if chosen[i] != rejected[i]:
            idx = i - 1 if i > 0 and chosen[i - 1] == " " else i
            break
    return {"prompt": chosen[:idx], "chosen": chosen[idx:], "rejected": rejected[idx:]}


def maybe_extract_prompt(example: dict[str, list]) -> dict[str, list]:
    """`extract_prompt` for preference rows whose prompt is implicit. A row that has a ``prompt`` of the same
    form (both strings or both conversations) as ``chosen`` is returned unchanged; a ``prompt`` of the other
    form (some datasets add a string prompt beside full conversations) is replaced by the extracted one.

    See docs/dataset_formats.md.
    """
    if "chosen" not in example or "rejected" not in example:
        return example
    if "prompt" in example:
        if is_conversational({"chosen": example["chosen"]}) == is_conversational({"prompt": example["prompt"]}):
            return example
    return extract_prompt({"chosen": example["chosen"], "rejected": example["rejected"]})


def get_dataset_column_names(dataset) -> list[str]:
    """Column names, also for an IterableDataset whose features are unknown (read from its first row)."""
    return list(next(iter(dataset)).keys()) if dataset.column_names is None else dataset.column_names


def common_prefix_length(ids: list[int], other_ids: list[int]) -> int:
    """How many leading tokens the two sequences share (where a completion starts when a template renders the
    prompt alone differently from the prompt followed by a completion)."""
    n = 0
    for a, b in zip(ids, other_ids):
        if a != b:
            break
        n += 1
    return n


def _unpair_batch(batch: dict[str, list]) -> dict[str, list]:
    n = len(batch["chosen"])
    out = {"completion": batch["chosen"] + batch["rejected"], "label": [True] * n + [False] * n}
    for key, values in batch.items():
        if key not in ("chosen", "rejected"):
            out[key] = values + values
    return out


def unpair_preference_dataset(dataset, **map_kwargs):
    """Turns paired preference data into unpaired rows with a desirable/undesirable label, as KTO reads them.

    Paired preference rows (``[prompt], chosen, rejected``) -> unpaired rows (``[prompt], completion,
    label``): within each map batch, every chosen row (label True) then every rejected one (label False);
    other columns are repeated. `map_kwargs` go to ``dataset.map``. Works on (Iterable)Dataset(Dict).

    See docs/dataset_formats.md.
    """
    if hasattr(dataset, "keys"):
        column_names = get_dataset_column_names(next(iter(dataset.values())))
    else:
        column_names = get_dataset_column_names(dataset)
    return dataset.map(_unpair_batch, batched=True, remove_columns=column_names, **map_kwargs)


def maybe_unpair_preference_dataset(dataset, num_proc: int | None = None, desc: str | None = None):
    """`unpair_preference_dataset` if the dataset has ``chosen`` and ``rejected`` columns, else the dataset.

    See docs/dataset_formats.md.
    """
    column_names = next(iter(dataset.values())).column_names if hasattr(dataset, "keys") else dataset.column_names
    if "chosen" in column_names and "rejected" in column_names:
        return unpair_preference_dataset(dataset, num_proc=num_proc, desc=desc)
    return dataset
