"""docs/architecture.md's "where a change goes" rows for a reward function, a policy loss type, an experimental
method and a model family name real places: every file exists (a `<m>` or `<family>` placeholder matches at least one
file) and every table (an upper-case name such as `REWARD_FUNCTIONS`) is assigned at module level in a file of its
row."""

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
ROWS = ("a reward function", "a policy loss type", "an experimental method", "a model family")
CODE = re.compile(r"`([^`]+)`")


def _row(change: str) -> str:
    lines = [line for line in (ROOT / "docs" / "architecture.md").read_text().splitlines() if line.startswith("|")]
    found = [line for line in lines if line.split("|")[1].strip() == change]
    assert len(found) == 1, f"docs/architecture.md has {len(found)} rows for {change!r}, wants one"
    return found[0]


def _files(path: str) -> list[Path]:
    """The files a cited path means: tests/ and docs/ from the repository root, the rest inside posttrain/."""
    base = ROOT if path.split("/")[0] in ("tests", "docs") else ROOT / "posttrain"
    return sorted(base.glob(re.sub(r"<[^>]+>", "*", path)))


def _paths(row: str) -> list[str]:
    return [c for c in CODE.findall(row) if c.endswith((".py", ".md"))]


def _tables(row: str) -> list[str]:
    return [c for c in CODE.findall(row) if re.fullmatch(r"[A-Z][A-Z0-9_]+", c)]


def _assigned(path: Path) -> set[str]:
    names = set()
    for node in ast.parse(path.read_text()).body:
        targets = (
            node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AnnAssign) else []
        )
        names |= {t.id for t in targets if isinstance(t, ast.Name)}
    return names


def test_the_resolver_knows_a_missing_file():
    assert _files("losses/policy.py") == [ROOT / "posttrain" / "losses" / "policy.py"]
    assert _files("tests/docs/test_architecture_doc.py") == [Path(__file__).resolve()]
    assert _files("losses/no_such_module.py") == []
    assert len(_files("experimental/<m>/<m>_trainer.py")) >= 10


@pytest.mark.parametrize("change", ROWS)
def test_every_file_a_row_names_exists(change):
    paths = _paths(_row(change))
    assert len(paths) >= 2, f"the row for {change!r} names {paths}: too few files to say where the change goes"
    missing = [p for p in paths if not _files(p)]
    assert not missing, f"docs/architecture.md, row {change!r}: no such file {missing}"


@pytest.mark.parametrize("change", ROWS)
def test_every_table_a_row_names_is_defined_in_its_files(change):
    row = _row(change)
    sources = [f for p in _paths(row) if p.endswith(".py") for f in _files(p)]
    defined = set().union(*(_assigned(f) for f in sources))
    missing = [t for t in _tables(row) if t not in defined]
    assert not missing, f"docs/architecture.md, row {change!r}: {missing} not assigned in {[str(f) for f in sources]}"
