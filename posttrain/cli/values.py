"""Values for config fields from text (the command line) or YAML: each converted to its field's annotated type
(`convert_value`), and dataclasses built from such values (`build_dataclass`). A value that does not fit is a
`ConfigError` naming the flag or key and the type expected. Booleans are ``true``/``false``, lists are several
values or a JSON list, dicts are JSON objects, and ``null`` sets an optional setting to None (``none`` too, where
the setting takes no strings).
"""

from __future__ import annotations

import dataclasses
import difflib
import enum
import json
import types
import typing
from typing import Any, Literal

from posttrain.errors import ConfigError

BOOL_TEXTS = {"true": True, "false": False}


def field_hints(cls: type) -> dict[str, Any]:
    """Field name -> resolved type annotation, for the fields the constructor takes."""
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls) if f.init}


def _describe(hint: Any) -> str:
    """A short, readable name of a type for error messages and --help."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if hint is bool:
        return "true or false"
    if is_enum(hint):
        return "one of " + ", ".join(repr(member.value) for member in hint)
    if origin is Literal:
        return "one of " + ", ".join(
            str(option).lower() if isinstance(option, bool) else repr(option) for option in args
        )
    if origin in (typing.Union, types.UnionType):
        described = [_describe(member) for member in union_candidates(args)]
        return " or ".join(described + (["none"] if type(None) in args else []))
    if hint is type(None):
        return "none"
    if origin is list or hint is list:
        return f"a list (each {_describe(args[0])})" if args else "a list"
    if origin is dict or hint is dict:
        return "a JSON object"
    if dataclasses.is_dataclass(hint):
        return f"a JSON object of {hint.__name__} fields"
    return {int: "an integer", float: "a number", str: "a string"}.get(hint, getattr(hint, "__name__", str(hint)))


def is_enum(hint: Any) -> bool:
    """Whether `hint` is an Enum class."""
    return isinstance(hint, type) and issubclass(hint, enum.Enum)


class _Mismatch(ValueError):
    """The value does not fit the type; a message, when there is one, says more than the expected type."""


def _parse_json(value: str, expected: type) -> Any:
    try:
        parsed = json.loads(value)
    except json.JSONDecodeError as err:
        raise _Mismatch(f"not valid JSON: {err}") from None
    if not isinstance(parsed, expected):
        raise _Mismatch(f"valid JSON, but not a {'JSON object' if expected is dict else 'JSON list'}")
    return parsed


def _number(text: str, kind: type) -> int | float:
    try:
        return kind(text.strip())
    except ValueError:
        raise _Mismatch() from None


def _convert(value: Any, hint: Any) -> Any:
    """`value` (command-line text, or a YAML value) as `hint`; raises ValueError when it does not fit."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if hint is Any:
        return value
    if origin in (typing.Union, types.UnionType):
        return _convert_union(value, args)
    if hint is type(None):
        if value is None or _is_none_text(value, takes_strings=False):
            return None
        raise _Mismatch()
    if hint is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in BOOL_TEXTS:
            return BOOL_TEXTS[value.lower()]
        raise _Mismatch()
    if hint is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, str):
            return _number(value, int)
        raise _Mismatch()
    if hint is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):
            return _number(value, float)
        raise _Mismatch()
    if hint is str:
        if isinstance(value, (str, int, float)) and not isinstance(value, bool):
            return str(value)
        raise _Mismatch()
    if origin is Literal:
        for option in args:
            if value == option or (isinstance(value, str) and value.lower() == str(option).lower()):
                return option
        raise _Mismatch()
    if is_enum(hint):
        for member in hint:
            if value == member or value == member.value:
                return member
        raise _Mismatch()
    if origin is list or hint is list:
        return _convert_list(value, args)
    if origin is dict or hint is dict:
        mapping = _parse_json(value, dict) if isinstance(value, str) else value
        if not isinstance(mapping, dict):
            raise _Mismatch()
        if len(args) == 2:
            return {_convert(key, args[0]): _convert(item, args[1]) for key, item in mapping.items()}
        return mapping
    if dataclasses.is_dataclass(hint):
        mapping = _parse_json(value, dict) if isinstance(value, str) else value
        if not isinstance(mapping, dict):
            raise _Mismatch()
        return build_dataclass(hint, mapping, where=hint.__name__)
    raise _Mismatch("this type cannot be given as text; set it from Python")


def _convert_list(value: Any, args: tuple) -> list:
    """Lists come as several command-line values, a JSON list, a YAML list, or one single value."""
    if isinstance(value, str) and value.lstrip().startswith("["):
        value = _parse_json(value, list)
    items = value if isinstance(value, list) else [value]
    item_hint = args[0] if args else Any
    return [_convert(item, item_hint) for item in items]


def _union_order(member: Any) -> int:
    """Try the strictest types first, so that '3' is an int before it is a string and a single value before a
    list; a string goes last but one, then the containers."""
    origin = typing.get_origin(member) or member
    order = [bool, int, float, Literal, enum.Enum, dict, str, list]
    if is_enum(member):
        return order.index(enum.Enum)
    if dataclasses.is_dataclass(member):
        return order.index(dict)
    return order.index(origin) if origin in order else len(order)


def union_candidates(members: tuple) -> list:
    """The types a union accepts from text, None aside. In `SchedulerType | str` the string alternative exists
    for Python callers; the command line takes the enum's choices."""
    candidates = [m for m in members if m is not type(None)]
    if str in candidates and any(is_enum(m) for m in candidates):
        candidates.remove(str)
    return candidates


def _is_none_text(value: Any, takes_strings: bool) -> bool:
    """ "null" always means None; "none" only where the setting takes no strings (report_to="none" is a string)."""
    return isinstance(value, str) and (value.lower() == "null" or (not takes_strings and value.lower() == "none"))


def _convert_union(value: Any, members: tuple) -> Any:
    if type(None) in members and (value is None or _is_none_text(value, str in members)):
        return None
    candidates = union_candidates(members)
    if isinstance(value, list):
        candidates = [m for m in candidates if (typing.get_origin(m) or m) is list] or candidates
    for member in sorted(candidates, key=_union_order):
        try:
            return _convert(value, member)
        except (ValueError, TypeError):
            continue
    raise _Mismatch()


def convert_value(value: Any, hint: Any, where: str) -> Any:
    """`value` as type `hint`; a value that does not fit raises a ConfigError naming `where` (flag or key)."""
    try:
        return _convert(value, hint)
    except ConfigError:
        raise
    except (ValueError, TypeError) as err:
        detail = f" ({err})" if isinstance(err, _Mismatch) and str(err) else ""
        if isinstance(value, bool):
            detail += " YAML reads unquoted yes/no/on/off as true/false: quote the value, e.g. 'no'"
        raise ConfigError(f"{where}: got {value!r}, expected {_describe(hint)}{detail}.") from None


def unknown_name_message(name: str, known: list[str], prefix: str = "") -> str:
    """No setting `name`; suggests the closest known name (difflib)."""
    close = difflib.get_close_matches(name, known, n=1, cutoff=0.6)
    hint = f" Did you mean {prefix}{close[0]}?" if close else f" See --help for the {len(known)} settings."
    return f"unknown setting {prefix}{name}.{hint}"


def build_dataclass(cls: type, values: dict[str, Any], where: str) -> Any:
    """`cls(**values)` with every value converted; an unknown key is a ConfigError with a suggestion."""
    hints = field_hints(cls)
    for key in values:
        if key not in hints:
            raise ConfigError(f"{where}: {unknown_name_message(str(key), list(hints))}")
    missing = [
        f.name
        for f in dataclasses.fields(cls)
        if f.init
        and f.name not in values
        and f.default is dataclasses.MISSING
        and f.default_factory is dataclasses.MISSING
    ]
    if missing:
        raise ConfigError(f"{where}: {missing[0]} is required; got {values}.")
    converted = {key: convert_value(value, hints[key], f"{where}: {key}") for key, value in values.items()}
    return cls(**converted)
