"""Command-line flags and YAML keys generated from config dataclasses.

Every field of a dataclass becomes ``--<field>``, typed by its annotation, so the command line never lags the
configs. The same conversion serves text from the command line and values from a YAML file (where ``1e-5`` is
a string and ``learning_rate: 1`` an int), and every mistake is a `ConfigError` naming the flag or key.
Booleans are ``true``/``false``, lists are several values or a JSON list, dicts are JSON objects, and ``null``
sets an optional setting to None (``none`` too, where the setting takes no strings).
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import enum
import json
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from posttrain.cli.model import ModelConfig
from posttrain.errors import ConfigError

BOOL_TEXTS = {"true": True, "false": False}
# Longer lists of choices go into the help text instead of the usage line.
MAX_METAVAR_CHOICES = 6


# The model flags are TRL's ModelConfig; the old name stays for existing imports.
ModelArguments = ModelConfig


@dataclass
class RewardArguments:
    """The rewards of the online methods (GRPO, RLOO, PPO); their weights are the config's `reward_weights`."""

    reward_model_name_or_path: str | None = field(
        default=None,
        metadata={
            "help": "A reward model (hub id or local directory of a sequence classifier), "
            "scored before the reward_funcs."
        },
    )
    reward_funcs: list[str] | None = field(
        default=None,
        metadata={
            "help": "Reward functions: names from posttrain.rewards.REWARD_FUNCTIONS, dotted import paths "
            "(mypkg.rewards.my_reward), or reward model ids/paths."
        },
    )


@dataclass
class LaunchArguments:
    """How many processes train; more than one re-launches the command through `accelerate launch`."""

    num_processes: int = field(default=1, metadata={"help": "Training processes (>1 re-launches via accelerate)."})
    accelerate_config: str | None = field(
        default=None, metadata={"help": "An accelerate config file (from `accelerate config`) to launch with."}
    )


@dataclass(frozen=True)
class FlagGroup:
    """The flags of one dataclass, shown under one heading of --help; `names` are the fields it owns."""

    title: str
    cls: type
    names: tuple[str, ...]

    def split(self, settings: dict[str, Any]) -> dict[str, Any]:
        """The settings that belong to this group's dataclass."""
        return {name: value for name, value in settings.items() if name in self.names}


def flag_groups(*titled_classes: tuple[str, type]) -> list[FlagGroup]:
    """One group per dataclass; a field name owned by an earlier class is not repeated by a later one."""
    taken: set[str] = set()
    groups = []
    for title, cls in titled_classes:
        names = tuple(f.name for f in dataclasses.fields(cls) if f.init and f.name not in taken)
        taken.update(names)
        groups.append(FlagGroup(title, cls, names))
    return groups


def field_hints(cls: type) -> dict[str, Any]:
    """Field name -> resolved type annotation, for the fields the constructor takes."""
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls) if f.init}


# -- converting one value ----------------------------------------------------------------------------------------


def _describe(hint: Any) -> str:
    """A short, readable name of a type for error messages and --help."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if hint is bool:
        return "true or false"
    if _is_enum(hint):
        return "one of " + ", ".join(repr(member.value) for member in hint)
    if origin is Literal:
        return "one of " + ", ".join(
            str(option).lower() if isinstance(option, bool) else repr(option) for option in args
        )
    if origin in (typing.Union, types.UnionType):
        described = [_describe(member) for member in _union_candidates(args)]
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


def _is_enum(hint: Any) -> bool:
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
    if _is_enum(hint):
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
    if _is_enum(member):
        return order.index(enum.Enum)
    if dataclasses.is_dataclass(member):
        return order.index(dict)
    return order.index(origin) if origin in order else len(order)


def _union_candidates(members: tuple) -> list:
    """The types a union accepts from text, None aside. In `SchedulerType | str` the string alternative exists
    for Python callers; the command line takes the enum's choices."""
    candidates = [m for m in members if m is not type(None)]
    if str in candidates and any(_is_enum(m) for m in candidates):
        candidates.remove(str)
    return candidates


def _is_none_text(value: Any, takes_strings: bool) -> bool:
    """ "null" always means None; "none" only where the setting takes no strings (report_to="none" is a string)."""
    return isinstance(value, str) and (value.lower() == "null" or (not takes_strings and value.lower() == "none"))


def _convert_union(value: Any, members: tuple) -> Any:
    if type(None) in members and (value is None or _is_none_text(value, str in members)):
        return None
    candidates = _union_candidates(members)
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


# -- the command line and the YAML file --------------------------------------------------------------------------


class CommandParser(argparse.ArgumentParser):
    """argparse that reports mistakes as ConfigError (printed as one line by the command), not SystemExit."""

    def error(self, message: str) -> typing.NoReturn:
        raise ConfigError(f"{message}.")


def _nargs(hint: Any) -> str | None:
    """Bool flags may stand alone (`--use_peft` = true); list-typed flags take one or more values."""
    members = typing.get_args(hint) if typing.get_origin(hint) in (typing.Union, types.UnionType) else (hint,)
    if bool in members:
        return "?"
    if any((typing.get_origin(m) or m) is list for m in members):
        return "+"
    return None


def _choices(hint: Any) -> list[str] | None:
    """The accepted texts of a bool, Literal or Enum type (optional or not); None for open-ended types."""
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        members = _union_candidates(typing.get_args(hint))
        return _choices(members[0]) if len(members) == 1 else None
    if hint is bool:
        return ["true", "false"]
    if typing.get_origin(hint) is Literal:
        return [str(option).lower() if isinstance(option, bool) else str(option) for option in typing.get_args(hint)]
    if _is_enum(hint):
        return [str(member.value) for member in hint]
    return None


def _metavar(hint: Any) -> str:
    is_union = typing.get_origin(hint) in (typing.Union, types.UnionType)
    members = _union_candidates(typing.get_args(hint)) if is_union else [hint]
    choices = _choices(hint)
    if choices and len(choices) <= MAX_METAVAR_CHOICES:
        return "{" + ",".join(choices) + "}"
    if any((typing.get_origin(m) or m) is dict or dataclasses.is_dataclass(m) for m in members):
        return "JSON"
    return "VALUE"


def _default(info: dataclasses.Field) -> Any:
    if info.default_factory is not dataclasses.MISSING:
        return info.default_factory()
    return info.default


def build_parser(prog: str, description: str, groups: list[FlagGroup]) -> argparse.ArgumentParser:
    """An argparse parser with one flag per field; flags not given are absent from the parsed namespace."""
    return spec_parser(prog, description, [flag_spec(group) for group in groups])


def spec_parser(prog: str, description: str, specs: list[dict[str, Any]]) -> argparse.ArgumentParser:
    """The parser of `build_parser` from flag specs (`flag_spec`), which may come from the on-disk cache."""
    parser = CommandParser(
        prog=prog, usage=f"{prog} [--config run.yaml] [--flag VALUE ...]", description=description, allow_abbrev=False
    )
    parser.add_argument(
        "--config",
        metavar="FILE.yaml",
        default=argparse.SUPPRESS,
        help="YAML file with the same keys as the flags; flags given here override it.",
    )
    add_flag_specs(parser, specs)
    return parser


def flag_spec(group: FlagGroup) -> dict[str, Any]:
    """How each field of the group appears on the command line, as JSON-able data: the help text (with the
    choices and the default), metavar, nargs, and whether a `--no_<name>` spelling switches it off."""
    hints = field_hints(group.cls)
    fields = {f.name: f for f in dataclasses.fields(group.cls)}
    flags = []
    for name in group.names:
        text = fields[name].metadata.get("help", "")
        choices = _choices(hints[name])
        if choices and len(choices) > MAX_METAVAR_CHOICES:
            text = f"{text} Choices: {', '.join(choices)}.".strip()
        default = _default(fields[name])
        if default not in (None, dataclasses.MISSING):
            text = f"{text} (default: {default})".strip()
        nargs = _nargs(hints[name])
        # A setting that is on by default can be switched off with --no_<name>, as with TRL's parser.
        negatable = default is True and nargs == "?" and f"no_{name}" not in fields
        flags.append(
            {
                "name": name,
                "help": text,
                "default": repr(default),
                "metavar": _metavar(hints[name]),
                "nargs": nargs,
                "negatable": negatable,
            }
        )
    return {"title": group.title, "flags": flags}


def add_flags(parser: argparse.ArgumentParser, groups: list[FlagGroup]) -> None:
    """One `--<field>` per field of each group, under the group's heading; values stay text until converted."""
    add_flag_specs(parser, [flag_spec(group) for group in groups])


def add_flag_specs(parser: argparse.ArgumentParser, specs: list[dict[str, Any]]) -> None:
    for spec in specs:
        section = parser.add_argument_group(spec["title"])
        for flag in spec["flags"]:
            name, nargs = flag["name"], flag["nargs"]
            section.add_argument(
                *_spellings(name),
                dest=name,
                default=argparse.SUPPRESS,
                nargs=nargs,
                const="true" if nargs == "?" else None,
                metavar=flag["metavar"],
                help=flag["help"].replace("%", "%%"),
            )
            if flag["negatable"]:
                section.add_argument(
                    *_spellings(f"no_{name}"),
                    dest=name,
                    action="store_const",
                    const="false",
                    default=argparse.SUPPRESS,
                    help=argparse.SUPPRESS,
                )


def _spellings(name: str) -> list[str]:
    """`--some_setting` and, as TRL's (transformers') parser also accepts it, `--some-setting`."""
    return [f"--{name}"] + ([f"--{name.replace('_', '-')}"] if "_" in name else [])


def first_unknown(tokens: list[str], known: list[str]) -> ConfigError:
    for token in tokens:
        if token.startswith("-"):
            return ConfigError(unknown_name_message(token.lstrip("-").split("=", 1)[0], known, prefix="--"))
    return ConfigError(f"unexpected argument {tokens[0]!r}; every setting is a --flag VALUE pair.")


def read_yaml_mapping(path) -> dict[str, Any]:
    """The mapping a YAML config file holds (empty for an empty file), with clear errors for anything else."""
    import yaml

    file = Path(path)
    if not file.is_file():
        raise ConfigError(f"--config: {path} does not exist; pass the path of a YAML file.")
    try:
        loaded = yaml.safe_load(file.read_text(encoding="utf-8"))
    except yaml.YAMLError as err:
        raise ConfigError(f"{path} is not valid YAML: {err}") from None
    if loaded is None:
        return {}
    if not isinstance(loaded, dict):
        raise ConfigError(f"{path} must hold a mapping of settings (key: value lines), not {type(loaded).__name__}.")
    return loaded


def load_yaml_settings(path: str, hints: dict[str, Any], skip: frozenset[str] = frozenset()) -> dict[str, Any]:
    """The settings of a YAML config file, each converted to its field's type."""
    loaded = read_yaml_mapping(path)
    if not loaded:
        return {}
    export_env(loaded.pop("env", None), path)
    settings = {}
    for key, value in loaded.items():
        if key not in hints:
            raise ConfigError(f"{path}: {unknown_name_message(str(key), list(hints))}")
        settings[key] = value if key in skip else convert_value(value, hints[key], f"{path}: {key}")
    return settings


def export_env(env: Any, path: str) -> None:
    """A YAML config's `env:` mapping (as in TRL's configs) set in os.environ before anything else runs."""
    import os

    if env is None:
        return
    if not isinstance(env, dict):
        raise ConfigError(f"{path}: `env` must be a mapping of VARIABLE: value, not {type(env).__name__}.")
    for key, value in env.items():
        os.environ[str(key)] = str(value)


def parse_settings(parser: argparse.ArgumentParser, groups: list[FlagGroup], argv: list[str]) -> dict[str, Any]:
    """Settings from the YAML file (`--config`) overridden by the flags.

    Only the settings given in either place are returned; each dataclass keeps its own defaults for the rest.
    """
    hints = {}
    for group in groups:
        group_hints = field_hints(group.cls)
        hints.update({name: group_hints[name] for name in group.names})
    return parse_flags(parser, hints, argv)


def parse_flags(
    parser: argparse.ArgumentParser, hints: dict[str, Any], argv: list[str], skip: frozenset[str] = frozenset()
) -> dict[str, Any]:
    """`parse_settings` given each flag's type; the flags in `skip` are returned as given, unconverted."""
    namespace, unknown = parser.parse_known_args(argv)
    if unknown:
        raise first_unknown(unknown, list(hints))
    given = vars(namespace)
    config_path = given.pop("config", None)
    settings = load_yaml_settings(config_path, hints, skip) if config_path else {}
    for name, raw in given.items():
        # One value after a list-typed flag is read like a single value: `--report_to none`, `--x '[1, 2]'`.
        if isinstance(raw, list) and len(raw) == 1:
            raw = raw[0]
        settings[name] = raw if name in skip else convert_value(raw, hints[name], f"--{name}")
    return settings
