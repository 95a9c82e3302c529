"""Command-line flags and YAML keys generated from config dataclasses.

Every field of a dataclass becomes ``--<field>``, typed by its annotation, so the command line never lags the
configs. The same conversion (`posttrain.cli.values`) serves text from the command line and values from a YAML
file (where ``1e-5`` is a string and ``learning_rate: 1`` an int), and every mistake is a `ConfigError` naming the
flag or key.
"""

from __future__ import annotations

import argparse
import dataclasses
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from posttrain.cli.model import ModelConfig
from posttrain.cli.values import convert_value, field_hints, is_enum, union_candidates, unknown_name_message
from posttrain.errors import ConfigError

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
        members = union_candidates(typing.get_args(hint))
        return _choices(members[0]) if len(members) == 1 else None
    if hint is bool:
        return ["true", "false"]
    if typing.get_origin(hint) is Literal:
        return [str(option).lower() if isinstance(option, bool) else str(option) for option in typing.get_args(hint)]
    if is_enum(hint):
        return [str(member.value) for member in hint]
    return None


def _metavar(hint: Any) -> str:
    is_union = typing.get_origin(hint) in (typing.Union, types.UnionType)
    members = union_candidates(typing.get_args(hint)) if is_union else [hint]
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
        # Every on/off setting can be switched off with --no_<name>: TRL's parser offers it where TRL's default is on,
        # and a TRL command line keeps working where posttrain's default is off already (e.g. GOLD's
        # --no_remove_unused_columns).
        negatable = nargs == "?" and f"no_{name}" not in fields
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
