"""docs/online_step.md traces one GRPO step by name: every `posttrain.<module>.<name>` it cites must exist (the
longest importable module prefix, then attributes), and so must every file it names."""

from __future__ import annotations

import importlib
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs" / "online_step.md"


def cited_names(text: str) -> list[str]:
    """The dotted posttrain names opening a backtick span (a call's arguments after them are left out)."""
    return sorted(set(re.findall(r"`(posttrain(?:\.\w+)+)", text)))


def resolve(name: str):
    """The object `name` denotes: the longest prefix that imports as a module, then attribute by attribute."""
    parts = name.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            target = importlib.import_module(".".join(parts[:cut]))
        except ModuleNotFoundError:
            continue
        for attribute in parts[cut:]:
            target = getattr(target, attribute)
        return target
    raise ModuleNotFoundError(name)


def test_the_resolver_finds_what_exists_and_refuses_what_does_not():
    assert resolve("posttrain.losses.policy.aggregate_loss").__name__ == "aggregate_loss"
    assert cited_names("`posttrain.a.b(x, y)` and `posttrain.c`") == ["posttrain.a.b", "posttrain.c"]
    with pytest.raises(AttributeError):
        resolve("posttrain.losses.policy.no_such_function")


NAMES = cited_names(PAGE.read_text())


def test_the_page_cites_the_step():
    assert len(NAMES) > 40, "the pattern no longer finds the names the page cites"


@pytest.mark.parametrize("name", NAMES)
def test_every_cited_name_exists(name):
    assert resolve(name) is not None


def test_every_named_file_exists():
    files = set(re.findall(r"(?<![\w/.])((?:tests|docs|posttrain)/[\w/]*\.\w+)", PAGE.read_text()))
    assert files and not sorted(f for f in files if not (ROOT / f).exists())
