"""Start-up of the `posttrain` command: the cached flag spec must agree with the live config dataclasses, and
`--help`, `env` and flag mistakes must be answered without importing torch or transformers, with the same output
as the full parser built from the dataclasses.
"""

from __future__ import annotations

import dataclasses
import enum
import importlib
import json
import os
import subprocess
import sys
import types
import typing
from pathlib import Path

import pytest

from posttrain.cli import environment
from posttrain.cli import spec as cli_spec
from posttrain.cli.args import build_parser, field_hints

cli = importlib.import_module("posttrain.cli.main")  # the module (posttrain.cli.main is the function)

ENV = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}


@pytest.fixture()
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("POSTTRAIN_CACHE", str(tmp_path))
    monkeypatch.delenv("POSTTRAIN_CLI_CACHE", raising=False)
    return tmp_path


def _live_groups(name: str):
    method = cli.METHODS[name]
    return cli.command_groups(method, method.load()[1])


def _fill_cache(name: str) -> dict:
    """Runs `posttrain NAME --help` in this process (which writes the spec) and returns the spec on disk."""
    with pytest.raises(SystemExit) as done:
        cli.main([name, "--help"])
    assert done.value.code == 0
    files = list((Path(os.environ["POSTTRAIN_CACHE"]) / "cli").glob(f"{name}-*.json"))
    assert len(files) == 1, files
    return json.loads(files[0].read_text())


def _normal(hint):
    """A comparable form of a type annotation, enums by name and member values (the spec rebuilds them)."""
    if isinstance(hint, type) and issubclass(hint, enum.Enum):
        return ("enum", hint.__name__, tuple((member.name, member.value) for member in hint))
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        return ("union", frozenset(_normal(arg) for arg in args))
    if origin is not None:
        return (origin, tuple(_normal(arg) if origin is not typing.Literal else arg for arg in args))
    return hint


def _default(info: dataclasses.Field):
    return info.default_factory() if info.default_factory is not dataclasses.MISSING else info.default


@pytest.mark.parametrize("name", list(cli.METHODS))
def test_cached_spec_has_every_field_type_default_and_help(name, cache):
    stored = _fill_cache(name)
    groups = _live_groups(name)
    by_owner = {group["owner"]: group for group in stored["groups"]}
    assert len(by_owner) == len(groups)
    for group in groups:
        flags = {flag["name"]: flag for flag in by_owner[f"{group.cls.__module__}.{group.cls.__qualname__}"]["flags"]}
        assert list(flags) == list(group.names)
        hints = field_hints(group.cls)
        fields = {f.name: f for f in dataclasses.fields(group.cls)}
        for field_name in group.names:
            flag, info = flags[field_name], fields[field_name]
            decoded = cli_spec.decode_hint(flag["type"])
            if cli_spec.is_deferred(decoded):  # a type only the real config can convert: checked after import
                assert "deferred" in json.dumps(flag["type"]), field_name
            else:
                assert _normal(decoded) == _normal(hints[field_name]), field_name
            default = _default(info)
            assert flag["default"] == repr(default), field_name
            assert flag["help"].startswith(info.metadata.get("help", "").strip()), field_name
            if default not in (None, dataclasses.MISSING):
                assert flag["help"].endswith(f"(default: {default})"), field_name
    # The spec's parser prints exactly the help of the parser built from the dataclasses.
    ordered = cli.help_order(groups)
    live = build_parser(stored["prog"], stored["description"], ordered).format_help()
    assert cli.spec_parser(stored["prog"], stored["description"], stored["groups"]).format_help() == live


def test_help_leads_with_the_model_and_data_flags(cache):
    _fill_cache("grpo")
    stored = cli_spec.load_spec("grpo")
    titles = [group["title"] for group in stored["groups"]]
    assert titles == ["model", "data", "rewards", "training (GRPOConfig)", "processes"]
    text = cli.spec_parser(stored["prog"], stored["description"], stored["groups"]).format_help()
    assert text.index("--model_name_or_path") < text.index("--dataset_name") < text.index("--learning_rate")


def test_a_source_edit_or_version_change_invalidates_the_cache(cache, tmp_path, monkeypatch):
    package = tmp_path / "pkg"
    package.mkdir()
    source = package / "config.py"
    source.write_text("x = 1\n")
    monkeypatch.setattr(cli_spec, "PACKAGE_DIR", package)
    key = cli_spec.cache_key()
    cli_spec.store_spec("sft", {"format": cli_spec.FORMAT, "groups": []})
    assert cli_spec.load_spec("sft") == {"format": cli_spec.FORMAT, "groups": []}
    stat = source.stat()
    os.utime(source, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000))
    assert cli_spec.cache_key() != key
    assert cli_spec.load_spec("sft") is None
    os.utime(source, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert cli_spec.cache_key() == key
    monkeypatch.setattr(cli_spec, "__version__", "999.0")
    assert cli_spec.cache_key() != key
    monkeypatch.setenv("POSTTRAIN_CLI_CACHE", "0")  # the cache switched off: never read
    monkeypatch.setattr(cli_spec, "__version__", cli_spec.__version__)
    assert cli_spec.load_spec("sft") is None


def test_decoded_enum_converts_and_describes_like_the_original():
    from transformers.trainer_utils import SchedulerType

    from posttrain.cli.args import convert_value
    from posttrain.errors import ConfigError

    hint = SchedulerType | str
    decoded = cli_spec.decode_hint(json.loads(json.dumps(cli_spec.encode_hint(hint))))
    assert convert_value("cosine", decoded, "--x").value == convert_value("cosine", hint, "--x").value == "cosine"
    messages = []
    for candidate in (hint, decoded):
        with pytest.raises(ConfigError) as err:
            convert_value("bogus", candidate, "--lr_scheduler_type")
        messages.append(str(err.value))
    assert messages[0] == messages[1]


BAD_ARGV = [
    ["sft", "--learning_rate", "fast"],
    ["sft", "--learnin_rate", "1e-5"],
    ["sft", "--lr_scheduler_type", "bogus"],
    ["sft", "--model_name_or_path", "m", "--dataset_name", "d", "--lora_r", "8"],
    ["sft", "--dataset_name", "d"],
    ["sft", "--model_name_or_path", "m", "--dataset_name", "./missing.jsonl"],
    ["sft", "--model_name_or_path", "m", "--dataset_name", "d", "--num_processes", "0"],
    ["grpo", "--model_name_or_path", "m", "--dataset_name", "d"],
]


@pytest.mark.parametrize("argv", BAD_ARGV, ids=lambda argv: " ".join(argv[1:3]))
def test_early_errors_match_the_full_parser(argv, cache, monkeypatch, capsys, tmp_path):
    """The message from the cached spec is the one the command gives with the real config imported."""
    monkeypatch.chdir(tmp_path)
    _fill_cache(argv[0])
    capsys.readouterr()
    messages = []
    for switch in ("1", "0"):
        monkeypatch.setenv("POSTTRAIN_CLI_CACHE", switch)
        assert cli.main(argv) == 2
        messages.append(capsys.readouterr().err)
    assert messages[0] == messages[1]
    assert messages[0].startswith(f"posttrain {argv[0]}: error: ")


PROBE = """
import sys
from posttrain.cli.main import main
try:
    code = main(sys.argv[1:])
except SystemExit as done:
    code = done.code
heavy = sorted(name for name in ("torch", "transformers", "datasets", "accelerate") if name in sys.modules)
print("HEAVY", heavy, file=sys.stderr)
sys.exit(code)
"""


def test_help_env_and_flag_errors_need_no_torch(cache, tmp_path):
    _fill_cache("sft")
    env = {**ENV, "POSTTRAIN_CACHE": str(cache)}
    stored = cli_spec.load_spec("sft")
    expected_help = cli.spec_parser(stored["prog"], stored["description"], stored["groups"]).format_help()
    cases = [
        (["sft", "--help"], 0),
        (["env"], 0),
        (["--version"], 0),
        (["sft", "--learning_rate", "x"], 2),
        (["sft", "--bogus_flag", "1"], 2),
    ]
    for argv, status in cases:
        done = subprocess.run(
            [sys.executable, "-c", PROBE, *argv], env=env, text=True, capture_output=True, cwd=tmp_path, timeout=120
        )
        assert done.returncode == status, (argv, done.stderr)
        assert "HEAVY []" in done.stderr, (argv, done.stderr)
        if argv == ["sft", "--help"]:
            assert done.stdout == expected_help


@pytest.mark.parametrize(
    "text, expected",
    [
        ("cuda: Optional[str] = '12.4'\nhip: Optional[str] = None\n", {"cuda": "12.4"}),
        ('cuda = None\nhip = "6.2.41133"\n', {"hip": "6.2.41133"}),
        ("cuda: Optional[str] = None\nhip: Optional[str] = None\n", {}),
    ],
)
def test_torch_build_is_read_from_version_file(text, expected, tmp_path):
    version = tmp_path / "version.py"
    version.write_text(text)
    assert environment._torch_build(version) == expected


def test_env_accelerator_agrees_with_torch():
    import torch

    line = environment._accelerator()
    if torch.cuda.is_available():
        assert line.startswith(f"CUDA {torch.version.cuda}: {torch.cuda.device_count()} x ")
    else:
        assert line.startswith("none, CPU only")
