"""`TrlParser`: TRL's script parser (dataclasses -> flags, a YAML `--config` whose keys fill any of them, flags
over the YAML, an `env:` section exported to the environment), built on posttrain's flag machinery so that
values convert the same way as on the `posttrain` command line and every mistake is a ConfigError naming the flag
or key. Also `init_zero_verbose`, TRL's quiet-logging helper for scripts.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import sys
import warnings
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from posttrain.cli.args import CommandParser, add_flags, export_env, first_unknown, flag_groups, read_yaml_mapping
from posttrain.cli.values import convert_value, field_hints, unknown_name_message
from posttrain.errors import ConfigError, PosttrainError


def _launcher_options() -> set[str]:
    """Keys that belong to `accelerate launch` (and TRL's `accelerate_config`): in a YAML config read by a TRL
    script they are meant for the launcher, so the script leaves them alone."""
    from accelerate.commands.launch import launch_command_parser

    return {action.dest for action in launch_command_parser()._actions} | {"accelerate_config"}


class TrlParser(CommandParser):
    """The argument parser of TRL's scripts: command-line flags and a YAML `--config` file into the script's
    dataclasses.

    Parses command-line flags and a YAML `--config` file into instances of `dataclass_types` (TRL's API:
    `parse_args_and_config`, `parse_args_into_dataclasses`, `parse_dict`, `parse_yaml_file`, ...).

    A field that several of the dataclasses declare is one flag whose value goes to each of them.

    See docs/cli.md.
    """

    def __init__(self, dataclass_types=None, **kwargs):
        if dataclass_types is None:
            dataclass_types = []
        elif not isinstance(dataclass_types, Iterable):
            dataclass_types = [dataclass_types]
        self.dataclass_types = list(dataclass_types)
        for cls in self.dataclass_types:
            if not dataclasses.is_dataclass(cls):
                raise ConfigError(f"TrlParser takes dataclass types; {cls!r} is not one.")
            if "config" in {f.name for f in dataclasses.fields(cls)}:
                raise ConfigError(
                    f"{cls.__name__} has a field named 'config', which is reserved for the YAML file "
                    "path (--config); rename the field."
                )
        super().__init__(**kwargs)
        self.add_argument(
            "--config",
            metavar="FILE.yaml",
            default=None,
            help="YAML file whose keys fill the settings below; flags given here override it.",
        )
        groups = flag_groups(*[(cls.__name__, cls) for cls in self.dataclass_types])
        add_flags(self, groups)
        self._hints: dict[str, Any] = {}
        for group in groups:
            group_hints = field_hints(group.cls)
            self._hints.update({name: group_hints[name] for name in group.names})
        self._config_values: dict[str, Any] = {}

    # -- building the dataclasses ------------------------------------------------------------------------------

    def _build(self, settings: dict[str, Any]) -> tuple:
        outputs = []
        for cls in self.dataclass_types:
            fields = [f for f in dataclasses.fields(cls) if f.init]
            values = {f.name: settings[f.name] for f in fields if f.name in settings}
            for f in fields:
                if (
                    f.name not in values
                    and f.default is dataclasses.MISSING
                    and f.default_factory is dataclasses.MISSING
                ):
                    raise ConfigError(
                        f"--{f.name} is required ({cls.__name__}.{f.name} has no default); pass it as "
                        f"a flag or as `{f.name}:` in the --config file."
                    )
            try:
                outputs.append(cls(**values))
            except PosttrainError:
                raise
            except ValueError as err:  # e.g. TrainingArguments' checks of incompatible settings
                raise ConfigError(f"{cls.__name__}: {' '.join(str(err).split())}") from None
        return tuple(outputs)

    def _convert_mapping(self, mapping: dict[str, Any], where: str) -> tuple[dict[str, Any], list[str]]:
        """(known keys converted to their field types, unknown keys)."""
        known, unknown = {}, []
        for key, value in mapping.items():
            if key in self._hints:
                known[key] = convert_value(value, self._hints[key], f"{where}{key}")
            else:
                unknown.append(str(key))
        return known, unknown

    # -- TRL's entry points -------------------------------------------------------------------------------------

    def parse_args_into_dataclasses(
        self,
        args=None,
        return_remaining_strings: bool = False,
        look_for_args_file: bool = True,
        args_filename=None,
        args_file_flag=None,
    ):
        """Flags (over the values of an earlier `set_defaults_with_config`) -> one instance per dataclass; with
        `return_remaining_strings` the tokens no flag took come last instead of raising."""
        args = list(sys.argv[1:] if args is None else args)
        args = self._args_file_tokens(look_for_args_file, args_filename, args_file_flag, args) + args
        namespace, remaining = self.parse_known_args(args)
        given = vars(namespace)
        config_path = given.pop("config", None)
        if config_path is not None:
            raise ConfigError(
                f"--config {config_path}: YAML files are read by parse_args_and_config(); call it "
                "instead of parse_args_into_dataclasses()."
            )
        settings = dict(self._config_values)
        for name, raw in given.items():
            if isinstance(raw, list) and len(raw) == 1:  # `--report_to none`, `--x '[1, 2]'`
                raw = raw[0]
            settings[name] = convert_value(raw, self._hints[name], f"--{name}")
        outputs = self._build(settings)
        if return_remaining_strings:
            return (*outputs, remaining)
        if remaining:
            raise first_unknown(remaining, list(self._hints))
        return outputs

    def _args_file_tokens(self, look_for_args_file, args_filename, args_file_flag, args) -> list[str]:
        """transformers' `.args` files: `<script>.args` beside the script, `args_filename`, or files named by
        `args_file_flag` (removed from `args`); each holds flags separated by whitespace."""
        files = []
        if args_file_flag:
            while args_file_flag in args:
                index = args.index(args_file_flag)
                if index + 1 >= len(args):
                    raise ConfigError(f"{args_file_flag} needs a file path after it.")
                files.append(Path(args.pop(index + 1)))
                args.pop(index)
        if args_filename:
            files.insert(0, Path(args_filename))
        elif look_for_args_file and sys.argv and sys.argv[0]:
            candidate = Path(sys.argv[0]).with_suffix(".args")
            if candidate.is_file():
                files.insert(0, candidate)
        tokens = []
        for file in files:
            if not file.is_file():
                raise ConfigError(f"args file {file} does not exist.")
            tokens += file.read_text(encoding="utf-8").split()
        return tokens

    def parse_dict(self, args: dict[str, Any], allow_extra_keys: bool = False) -> tuple:
        """A mapping of settings (Python values or text) -> one instance per dataclass."""
        known, unknown = self._convert_mapping(args, "")
        if unknown and not allow_extra_keys:
            raise ConfigError(unknown_name_message(unknown[0], list(self._hints)))
        return self._build(known)

    def parse_json_file(self, json_file, allow_extra_keys: bool = False) -> tuple:
        return self.parse_dict(json.loads(Path(json_file).read_text(encoding="utf-8")), allow_extra_keys)

    def parse_yaml_file(self, yaml_file, allow_extra_keys: bool = False) -> tuple:
        return self.parse_dict(read_yaml_mapping(yaml_file), allow_extra_keys)

    def set_defaults_with_config(self, **kwargs) -> list[str]:
        """Makes the given values the defaults that flags override; returns `--key value` strings of the keys no
        dataclass has (TRL's return value)."""
        known, unknown = self._convert_mapping(kwargs, getattr(self, "_config_where", "--config: "))
        self._config_values.update(known)
        return [item for key in unknown for item in (f"--{key}", str(kwargs[key]))]

    def parse_args_and_config(
        self,
        args=None,
        return_remaining_strings: bool = False,
        fail_with_unknown_args: bool = True,
        separate_remaining_strings: bool = False,
    ):
        """The YAML `--config` file (its `env:` mapping exported to os.environ) overridden by the flags -> one
        instance per dataclass.

        A YAML key no dataclass has is an error: with `fail_with_unknown_args=False` (what TRL's scripts pass)
        only keys of `accelerate launch`, which the `trl` launcher consumes, are left alone; any other key would
        otherwise be ignored silently. With `return_remaining_strings` unknown keys and flags are returned.
        """
        args = list(sys.argv[1:] if args is None else args)
        config_path = _pop_config(args)
        config_remaining, unknown_keys = [], []
        if config_path is not None:
            config = read_yaml_mapping(config_path)
            export_env(config.pop("env", None), config_path)
            self._config_where = f"{config_path}: "
            config_remaining = self.set_defaults_with_config(**config)
            unknown_keys = config_remaining[::2]
        output = self.parse_args_into_dataclasses(args=args, return_remaining_strings=return_remaining_strings)
        if return_remaining_strings:
            if separate_remaining_strings:
                return (*output[:-1], config_remaining, output[-1])
            return (*output[:-1], config_remaining + output[-1])
        refused = (
            unknown_keys
            if fail_with_unknown_args
            else [key for key in unknown_keys if key[2:] not in _launcher_options()]
        )
        if refused:
            raise ConfigError(f"{config_path}: {unknown_name_message(refused[0][2:], list(self._hints))}")
        return output


def _pop_config(args: list[str]) -> str | None:
    """Removes `--config PATH` (or `--config=PATH`) from `args`; returns PATH."""
    for index, token in enumerate(args):
        if token == "--config":
            if index + 1 >= len(args):
                raise ConfigError("--config needs the path of a YAML file after it.")
            args.pop(index)
            return args.pop(index)
        if token.startswith("--config="):
            return args.pop(index).split("=", 1)[1]
    return None


def init_zero_verbose() -> None:
    """Quiets logging in training scripts, as TRL's scripts call it at start-up.

    Quiet logging for scripts: only errors, one line each (through rich when installed), and Python warnings
    routed into the log instead of printed with their source line.

    See docs/cli.md.
    """
    from transformers.utils import is_rich_available

    if is_rich_available():
        from rich.logging import RichHandler

        handler = RichHandler()
    else:
        handler = logging.StreamHandler()
    logging.basicConfig(format="%(message)s", datefmt="[%X]", handlers=[handler], level=logging.ERROR)

    def log_warning(message, category, filename, lineno, file=None, line=None):
        logging.warning(f"{filename}:{lineno}: {category.__name__}: {message}")

    warnings.showwarning = log_warning
