"""docs/getting_started.md's install section agrees with the package (issue 44): its table of supported versions
with pyproject.toml's requirements and scripts/constraints.txt's tested pins, its wheel's file name with the version,
and .ci/run runs the wheel check the page promises."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

tomllib = pytest.importorskip("tomllib")

ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs" / "getting_started.md"


def version_table() -> dict[str, tuple[str, str]]:
    """package -> (required, tested) from the page's "| package | required | tested |" table."""
    rows, inside = {}, False
    for line in PAGE.read_text().splitlines():
        if re.match(r"^\|\s*package\s*\|\s*required\s*\|\s*tested\s*\|", line):
            inside = True
            continue
        if inside and line.startswith("|") and not set(line) <= set("|-: "):
            name, required, tested = (cell.strip().strip("`") for cell in line.strip("|").split("|"))
            rows[name] = (required, tested)
        elif inside and not line.startswith("|"):
            break
    return rows


def requirements() -> dict[str, str]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    found = {"Python": project["requires-python"]}
    for requirement in project["dependencies"]:
        name, specifier = re.match(r"^([A-Za-z0-9_.-]+)\s*(.*)$", requirement).groups()
        found[name] = specifier.replace(" ", "")
    return found


def pins() -> dict[str, str]:
    text = (ROOT / "scripts" / "constraints.txt").read_text()
    return dict(re.findall(r"^([A-Za-z0-9_.-]+)==(\S+)", text, re.M))


def test_the_version_table_matches_pyproject_and_the_constraints():
    table, required, pinned = version_table(), requirements(), pins()
    assert {"Python", "torch", "transformers"} <= set(table), table
    for name, (page_required, page_tested) in table.items():
        assert name in required, f"{name} is in the table but not a requirement of pyproject.toml"
        assert page_required.replace(" ", "") == required[name], (name, page_required, required[name])
        if name == "Python":
            assert page_tested == f"{sys.version_info.major}.{sys.version_info.minor}", (page_tested, sys.version)
        else:
            assert page_tested == pinned.get(name), (name, page_tested, pinned.get(name))
    main = {name for name in required if name in ("torch", "transformers", "accelerate", "datasets", "peft")}
    assert main <= set(table), f"add to the table: {sorted(main - set(table))}"


def test_the_wheel_name_on_the_page_is_the_version():
    from posttrain.version import __version__

    names = re.findall(r"posttrain-(\d[\w.]*)-py3-none-any\.whl", PAGE.read_text())
    assert names and set(names) == {__version__}, (names, __version__)


def test_ci_runs_the_wheel_check():
    ci = (ROOT / ".ci" / "run").read_text()
    assert re.search(r"^bash scripts/wheel_check\.sh\s*$", ci, re.M)
    script = (ROOT / "scripts" / "wheel_check.sh").read_text()
    for needed in ("-m build", "-m venv", "## Quickstart", "site-packages", "wpip check"):
        assert needed in script, needed
    readme = (ROOT / "README.md").read_text()
    assert re.search(r"## Quickstart\n.*?```python\n.*?SFTTrainer", readme, re.S), "the script runs this block"
