"""mkdocs hooks for the documentation site (mkdocs.yml: `hooks:`).

Two jobs, both done from the code at build time so that the reference cannot drift from it:

1. The pages name objects by their public path (`::: posttrain.GRPOConfig`). posttrain's top level imports its names
   lazily, which a static reader (griffe) cannot follow, so each such directive is pointed at the module that
   defines the object today. The pages never spell an internal module path; a module that moves needs no edit.
2. A config is a dataclass whose fields carry their help text in `metadata["help"]` (the command line builds its
   flags from it). After the directive of every such dataclass a table of its fields (type, default, help) is
   inserted: the fields posttrain declares or re-defaults first, the ones inherited unchanged from
   `transformers.TrainingArguments` in a collapsed block.
"""

from __future__ import annotations

import dataclasses
import html
import importlib
import re

DIRECTIVE = re.compile(r"^::: (?P<path>[\w.]+)[ \t]*$")


def _resolve(path: str):
    """The object named by a dotted public path (`posttrain.GRPOConfig`, `posttrain.rewards.accuracy_reward`)."""
    parts = path.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for name in parts[cut:]:
            obj = getattr(obj, name)
        return obj
    raise ImportError(f"cannot import {path!r}")


def _defining_path(path: str, obj) -> str:
    """`module.qualname` where `obj` is defined, when that differs from the public `path` (lazy re-exports)."""
    module, qualname = getattr(obj, "__module__", None), getattr(obj, "__qualname__", None)
    if not module or not qualname or "<" in qualname:
        return path
    return f"{module}.{qualname}"


def _cell(text: str) -> str:
    """Prose for a table cell: one line, HTML-escaped, pipes escaped."""
    text = " ".join(str(text).split())
    return html.escape(text, quote=False).replace("|", "\\|")


def _code_cell(text: str) -> str:
    """A code span for a table cell (Python-Markdown's tables do not split at a pipe inside backticks)."""
    text = " ".join(str(text).split()).replace("`", "'")
    return f"`{text}`"


def _type_name(annotation) -> str:
    if isinstance(annotation, str):
        text = annotation
    elif isinstance(annotation, type):
        text = annotation.__name__
    else:
        text = str(annotation)
    return re.sub(r"\b(typing|transformers\.\w+(\.\w+)*)\.", "", text)


def _default(field: dataclasses.Field) -> str:
    if field.default is not dataclasses.MISSING:
        value = field.default
    elif field.default_factory is not dataclasses.MISSING:
        value = field.default_factory()
    else:
        return "required"
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _rows(fields) -> list[str]:
    rows = ["| field | type | default | what it does |", "|---|---|---|---|"]
    for field in fields:
        rows.append(
            f"| `{field.name}` | {_code_cell(_type_name(field.type))} | {_code_cell(_default(field))} "
            f"| {_cell(field.metadata.get('help', ''))} |"
        )
    return rows


def config_fields_markdown(cls) -> str:
    """The markdown tables of a config dataclass's fields with their help."""
    from transformers import TrainingArguments

    inherited = {f.name: f for f in dataclasses.fields(TrainingArguments)}
    own, base = [], []
    for field in dataclasses.fields(cls):
        if not field.init:
            continue
        parent = inherited.get(field.name)
        same = (
            parent is not None
            and _default(parent) == _default(field)
            and parent.metadata.get("help") == field.metadata.get("help")
        )
        (base if same else own).append(field)
    lines = ["", f"**Fields of `{cls.__name__}`** ({len(own)} set or re-defaulted here):", ""]
    lines += _rows(own)
    if base:
        lines += ["", f'??? note "{len(base)} fields inherited unchanged from transformers.TrainingArguments"', ""]
        lines += ["    " + row for row in _rows(base)]
    return "\n".join(lines) + "\n"


def _has_field_help(obj) -> bool:
    return (
        isinstance(obj, type)
        and dataclasses.is_dataclass(obj)
        and any(f.metadata.get("help") for f in dataclasses.fields(obj))
    )


def rewrite(markdown: str) -> str:
    """The page with each `::: public.path` pointed at its defining module and config field tables added."""
    lines = markdown.split("\n")
    out: list[str] = []
    index = 0
    while index < len(lines):
        match = DIRECTIVE.match(lines[index])
        if not match:
            out.append(lines[index])
            index += 1
            continue
        path = match.group("path")
        obj = _resolve(path)
        out.append(f"::: {_defining_path(path, obj)}")
        index += 1
        while index < len(lines) and (lines[index].startswith("    ") or lines[index].startswith("\t")):
            out.append(lines[index])  # the directive's YAML options
            index += 1
        if _has_field_help(obj):
            out.append(config_fields_markdown(obj))
    return "\n".join(out)


def on_page_markdown(markdown, page, config, files):  # mkdocs hook
    return rewrite(markdown)
