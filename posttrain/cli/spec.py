"""The flags of each training command as plain data, cached on disk, so that `posttrain <method> --help` and
mistakes in flags or the YAML config are answered without importing torch, transformers or the trainer.

A command's flags come from its config dataclass, and importing the config means importing the trainer (~10 s).
The first run of a command writes its flag spec (every flag's group, help text, metavar, nargs and type, encoded
as JSON) to `$POSTTRAIN_CACHE/cli/`; later runs build the same argparse parser from it. The cache key is the
package version, the python version and the size and mtime of every posttrain source file and of transformers'
training arguments, so an edit or an upgrade makes the command rebuild the spec from the live dataclasses.
"""

from __future__ import annotations

import enum
import hashlib
import importlib.util
import json
import os
import sys
import types
import typing
from pathlib import Path
from typing import Any, Literal

from posttrain.cli.args import FlagGroup, flag_spec
from posttrain.cli.values import field_hints
from posttrain.version import __version__

FORMAT = 2
PACKAGE_DIR = Path(__file__).resolve().parent.parent
# Files outside posttrain whose edits change the flags: TrainingArguments' fields and their types.
DEPENDENCY_FILES = (
    ("transformers", "training_args.py"),
    ("transformers", "trainer_utils.py"),
    ("transformers", "__init__.py"),
)
_PRIMITIVES = {
    "bool": bool,
    "int": int,
    "float": float,
    "str": str,
    "None": type(None),
    "Any": Any,
    "dict": dict,
    "list": list,
}
_NAMES = {value: name for name, value in _PRIMITIVES.items()}


class Deferred:
    """Stands for a type the spec cannot rebuild (e.g. a dataclass of another library): such flags are checked
    only when the command imports the real config."""


# -- type annotations as JSON ------------------------------------------------------------------------------------


def encode_hint(hint: Any) -> Any:
    """A type annotation as JSON: a name ("int"), or {"union"|"list"|"dict"|"literal"|"enum"|"deferred": ...}."""
    if hint in _NAMES:
        return _NAMES[hint]
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        return {"union": [encode_hint(member) for member in args]}
    if origin is Literal:
        return {"literal": list(args)}
    if origin is list:
        return {"list": encode_hint(args[0]) if args else "Any"}
    if origin is dict:
        return {"dict": [encode_hint(arg) for arg in args]}
    if isinstance(hint, type) and issubclass(hint, enum.Enum):
        return {"enum": hint.__name__, "members": [[member.name, member.value] for member in hint]}
    return {"deferred": f"{getattr(hint, '__module__', '?')}.{getattr(hint, '__qualname__', repr(hint))}"}


def decode_hint(data: Any) -> Any:
    """The annotation `encode_hint` wrote; an enum comes back as a stand-in Enum with the same names and values,
    which converts and describes values exactly as the original does."""
    if isinstance(data, str):
        return _PRIMITIVES[data]
    if "union" in data:
        # A union of members known only at run time: typing.Union's subscript is the one spelling of it.
        return typing.Union[tuple(decode_hint(member) for member in data["union"])]  # noqa: UP007
    if "literal" in data:
        return Literal[tuple(data["literal"])]
    if "list" in data:
        return list[decode_hint(data["list"])]
    if "dict" in data:
        return dict[tuple(decode_hint(arg) for arg in data["dict"])] if data["dict"] else dict
    if "enum" in data:
        return enum.Enum(data["enum"], [tuple(member) for member in data["members"]])
    return Deferred


def is_deferred(hint: Any) -> bool:
    return hint is Deferred or any(is_deferred(arg) for arg in typing.get_args(hint))


# -- the spec of a command ---------------------------------------------------------------------------------------


def command_spec(prog: str, description: str, groups: list[FlagGroup]) -> dict[str, Any]:
    """Everything the parser of a command needs, as JSON-able data; groups in the order --help shows them."""
    specs = []
    for group in groups:
        entry = flag_spec(group)
        hints = field_hints(group.cls)
        for flag in entry["flags"]:
            flag["type"] = encode_hint(hints[flag["name"]])
        entry["owner"] = f"{group.cls.__module__}.{group.cls.__qualname__}"
        specs.append(entry)
    return {"format": FORMAT, "prog": prog, "description": description, "groups": specs}


def spec_hints(spec: dict[str, Any]) -> dict[str, Any]:
    """Flag name -> the type its value converts to."""
    return {flag["name"]: decode_hint(flag["type"]) for group in spec["groups"] for flag in group["flags"]}


def spec_names(spec: dict[str, Any], owner: type) -> tuple[str, ...]:
    """The flags that belong to the dataclass `owner` (empty when the command has no such group)."""
    path = f"{owner.__module__}.{owner.__qualname__}"
    return tuple(flag["name"] for group in spec["groups"] if group["owner"] == path for flag in group["flags"])


# -- the cache ---------------------------------------------------------------------------------------------------


def cache_key() -> str:
    """Changes whenever a flag could: posttrain's version and sources, python, and transformers' arguments."""
    digest = hashlib.sha256(f"{FORMAT} {__version__} {sys.version}".encode())
    files = sorted(PACKAGE_DIR.rglob("*.py"))
    spec = importlib.util.find_spec("transformers")
    if spec is not None and spec.submodule_search_locations:
        base = Path(list(spec.submodule_search_locations)[0])
        files += [base / name for _, name in DEPENDENCY_FILES]
    for file in files:
        try:
            stat = file.stat()
        except OSError:
            continue
        digest.update(f"{file} {stat.st_size} {stat.st_mtime_ns}\n".encode())
    return digest.hexdigest()[:24]


def cache_dir() -> Path:
    return Path(os.environ.get("POSTTRAIN_CACHE", "~/.cache/posttrain")).expanduser() / "cli"


def cache_path(command: str, key: str | None = None) -> Path:
    return cache_dir() / f"{command}-{key or cache_key()}.json"


def load_spec(command: str) -> dict[str, Any] | None:
    """The cached spec of `command`, or None when there is none for the current sources (or it is unreadable)."""
    if os.environ.get("POSTTRAIN_CLI_CACHE", "1") == "0":
        return None
    try:
        spec = json.loads(cache_path(command).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return spec if isinstance(spec, dict) and spec.get("format") == FORMAT else None


def store_spec(command: str, spec: dict[str, Any]) -> None:
    """Writes the spec (atomically; older specs of the command are removed). A cache that cannot be written
    only costs the next run its speed."""
    if os.environ.get("POSTTRAIN_CLI_CACHE", "1") == "0":
        return
    try:
        path = cache_path(command)
        path.parent.mkdir(parents=True, exist_ok=True)
        for old in path.parent.glob(f"{command}-*.json"):
            if old != path:
                old.unlink(missing_ok=True)
        partial = path.with_suffix(f".{os.getpid()}.tmp")
        partial.write_text(json.dumps(spec), encoding="utf-8")
        partial.replace(path)
    except OSError:
        pass
