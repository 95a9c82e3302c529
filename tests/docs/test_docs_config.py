"""The config defaults and flags that the pages quote agree with the code (issue 44).

Checked:
- every row of a page's "option | default" table against the default of the page's config (`PAGE_CONFIGS`), each
  name of a row against its own value (`packing`, `packing_strategy` | off, `"bfd"`);
- every inline `field=value` that its sentence calls a default ("default", "defaults"), and every
  "`field` (default V)" with a literal V, against the configs that have that field: it must be the default of at
  least one of them;
- the YAML that docs/cli.md shows from examples/grpo_smollm2.yaml holds the file's own values.
"""

from __future__ import annotations

import ast
import dataclasses
import importlib
import pkgutil
import re
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
# The config whose defaults each page's option table quotes.
PAGE_CONFIGS = {
    "trainers/sft.md": "SFTConfig",
    "trainers/reward.md": "RewardConfig",
    "trainers/dpo.md": "DPOConfig",
    "trainers/kto.md": "KTOConfig",
    "trainers/grpo.md": "GRPOConfig",
    "trainers/rloo.md": "RLOOConfig",
    "trainers/ppo.md": "PPOConfig",
    "trainers/distillation.md": "DistillationConfig",
    "tools.md": "GRPOConfig",
}
# Default cells that describe rather than quote a value.
DESCRIBED = re.compile(r"derived|the tokenizer's|the model's|where exact|^auto$|—|-$", re.I)
MISSING = object()


def all_configs() -> dict[str, type]:
    """Every config dataclass of posttrain and posttrain.experimental, by class name."""
    import posttrain
    import posttrain.experimental as experimental

    found = {name: getattr(posttrain, name) for name in posttrain.__all__ if name.endswith("Config")}
    for module in pkgutil.walk_packages(experimental.__path__, "posttrain.experimental."):
        if module.name.rsplit(".", 1)[-1].startswith("_"):
            continue
        try:
            loaded = importlib.import_module(module.name)
        except ImportError:  # an optional dependency (vLLM, an agent SDK) that is not installed
            continue
        for name, obj in vars(loaded).items():
            if name.endswith("Config") and dataclasses.is_dataclass(obj) and isinstance(obj, type):
                found.setdefault(name, obj)
    return found


def default_of(config: type, name: str):
    """The default of field `name` of `config` (MISSING when it has no such field or no default)."""
    for field in dataclasses.fields(config):
        if field.name == name:
            if field.default is not dataclasses.MISSING:
                return field.default
            if field.default_factory is not dataclasses.MISSING:
                return field.default_factory()
            return MISSING
    return MISSING


def parse_value(text: str):
    """A quoted value as Python: `off`/`on` are False/True, `None`, numbers, quoted strings, lists."""
    text = re.sub(r"\s*\(.*\)$", "", text.strip()).strip("`").strip()  # `None` (on): the value, then its meaning
    words = {"off": False, "on": True, "none": None, "true": True, "false": False}
    if text.lower() in words:
        return words[text.lower()]
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return text


def same(quoted, actual) -> bool:
    if isinstance(actual, bool) or isinstance(quoted, bool):
        return quoted is actual or quoted == actual
    if isinstance(actual, (int, float)) and isinstance(quoted, (int, float)):
        return float(quoted) == float(actual)
    if isinstance(actual, tuple):
        actual = list(actual)
    if hasattr(actual, "value"):  # an enum (transformers' IntervalStrategy, ...)
        actual = actual.value
    return quoted == actual


def option_rows(page: Path):
    """(line, names, defaults) of each row of the page's "| option | default |" tables."""
    lines = page.read_text().splitlines()
    inside = False
    for number, line in enumerate(lines, 1):
        if re.match(r"^\|\s*option\s*\|\s*default\s*\|", line):
            inside = True
            continue
        if not line.startswith("|"):
            inside = False
            continue
        if not inside or set(line) <= set("|-: "):
            continue
        cells = [cell.strip() for cell in line.strip("|").split("|")]
        names = re.findall(r"`(\w+)`", cells[0])
        yield number, names, cells[1]


def split_defaults(cell: str, count: int) -> list[str] | None:
    """The cell's one value per name (None when it describes rather than quotes)."""
    if DESCRIBED.search(cell.strip("` ")):
        return None
    parts = [cell] if count == 1 else re.split(r"\s*(?:,|/)\s+(?![^\[]*\])", cell)
    if len(parts) == 1 and count > 1:
        parts = parts * count
    return parts if len(parts) == count else None


@pytest.mark.parametrize("page", sorted(PAGE_CONFIGS))
def test_option_tables_quote_the_config_defaults(page):
    config = all_configs()[PAGE_CONFIGS[page]]
    wrong, checked = [], 0
    for line, names, cell in option_rows(DOCS / page):
        values = split_defaults(cell, len(names))
        if values is None:
            continue
        for name, value in zip(names, values):
            actual = default_of(config, name)
            if actual is MISSING:
                wrong.append(f"{page}:{line}: `{name}` is not a field of {config.__name__}")
                continue
            checked += 1
            if not same(parse_value(value), actual):
                wrong.append(f"{page}:{line}: `{name}` quoted as {value!r}, {config.__name__} has {actual!r}")
    assert checked >= 3, f"{page}: no option table found"
    assert not wrong, "\n".join(wrong)


INLINE = re.compile(r"`(?P<name>[a-z_][a-z0-9_]*)=(?P<value>[^`]+)`")


def inline_defaults():
    """(page:line, name, value) of every inline `name=value` in a sentence that calls it a default."""
    for page in [ROOT / "README.md", *sorted(DOCS.rglob("*.md"))]:
        text = page.read_text()
        for sentence in re.finditer(r"[^.!?\n]*(?:\n(?!\n)[^.!?\n]*)*[.!?]?", text):
            chunk = sentence.group(0)
            if not re.search(r"\bdefaults?\b", chunk):
                continue
            for match in INLINE.finditer(chunk):
                start = sentence.start() + match.start()
                line = text.count("\n", 0, start) + 1
                after = chunk[match.end() : match.end() + 14]
                before = chunk[max(0, match.start() - 14) : match.start()]
                if "default" in after or "default" in before:
                    yield f"{page.relative_to(ROOT)}:{line}", match.group("name"), match.group("value")


PAREN_DEFAULT = re.compile(r"`(?P<name>[a-z_][a-z0-9_]*)` \((?:[\w']+ )?default:? `?(?P<value>[^`),;: ]+)`?(?=[),;:])")


def parenthesised_defaults():
    """(page:line, name, value) of every "`name` (default V)" whose V is a literal: a number, a quoted string,
    True, False or None (a description such as "default: `epsilon`" is left out)."""
    for page in [ROOT / "README.md", *sorted(DOCS.rglob("*.md"))]:
        text = page.read_text()
        for match in PAREN_DEFAULT.finditer(text):
            value = parse_value(match.group("value"))
            if isinstance(value, str) and not match.group("value").startswith(('"', "'")):
                continue
            yield (
                f"{page.relative_to(ROOT)}:{text.count(chr(10), 0, match.start()) + 1}",
                match.group("name"),
                match.group("value"),
            )


def test_inline_defaults_match_a_config():
    configs = all_configs()
    wrong, checked = [], 0
    for where, name, value in [*inline_defaults(), *parenthesised_defaults()]:
        defaults = [default_of(c, name) for c in configs.values()]
        defaults = [d for d in defaults if d is not MISSING]
        if not defaults:
            continue  # a keyword argument of a function, not a config field
        checked += 1
        if not any(same(parse_value(value), d) for d in defaults):
            wrong.append(f"{where}: `{name}={value}` called a default; the configs have {defaults}")
    assert checked >= 10, checked
    assert not wrong, "\n".join(wrong)


def test_a_wrong_default_is_caught(tmp_path):
    """The checker itself: a table row quoting another value than the config's fails."""
    from posttrain import DPOConfig

    assert same(parse_value("0.1"), default_of(DPOConfig, "beta"))
    assert not same(parse_value("0.2"), default_of(DPOConfig, "beta"))
    assert same(parse_value("off"), default_of(DPOConfig, "use_weighting"))
    assert same(parse_value('`["sigmoid"]`'), default_of(DPOConfig, "loss_type"))
    page = tmp_path / "p.md"
    page.write_text("| option | default | x |\n|---|---|---|\n| `beta`, `ld_alpha` | 0.2, None | y |\n")
    assert list(option_rows(page)) == [(3, ["beta", "ld_alpha"], "0.2, None")]
    assert split_defaults("0.2, None", 2) == ["0.2", "None"]


def test_cli_page_yaml_holds_the_example_files_values():
    page = (DOCS / "cli.md").read_text()
    block = re.search(r"```yaml\n(.*?)```", page, re.S).group(1)
    shown = yaml.safe_load(block)
    real = yaml.safe_load((ROOT / "examples" / "grpo_smollm2.yaml").read_text())
    assert {key: real.get(key, MISSING) for key in shown} == shown


def test_a_model_path_under_outputs_is_one_an_example_writes():
    """`--model_name_or_path outputs/X` in the examples and docs (a model trained by an earlier step) names the
    output_dir of an example config, as examples/grpo_smollm2.yaml's comment does with the SFT config's."""
    sources = [*sorted((ROOT / "examples").glob("*.yaml")), ROOT / "README.md", *sorted(DOCS.rglob("*.md"))]
    written = set()
    for config in sorted((ROOT / "examples").glob("*.yaml")):
        written |= set(re.findall(r"^output_dir:\s*(outputs/[\w./-]+)", config.read_text(), re.M))
    used = {
        (str(source.relative_to(ROOT)), path)
        for source in sources
        for path in re.findall(r"--model_name_or_path\s+(outputs/[\w./-]+)", source.read_text())
    }
    assert written, "no example config writes an output_dir"
    wrong = sorted((source, path) for source, path in used if path not in written)
    assert not wrong, f"these read a model no example config writes ({sorted(written)}): {wrong}"
