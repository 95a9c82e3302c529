"""The README's headline figures agree with their results pages and state their conditions (issue 44).

Each row of the README's "Headline numbers" table links the results page that holds its measurement; every figure
the row quotes (a ratio such as 1.71x, a rate, a megabyte count, a percentage, a duration) must appear on that
page, so a figure changed on one side only fails here. Each row also names its conditions (quiet or loaded, the
number of runs) and the commit that recorded it, and that commit exists in the repository's history.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
# Figures: decimals and ratios (1.71x, 0.0687, 10.2), thousands (3,091), percentages (61%), times (6 min 31 s).
FIGURE = re.compile(r"(?<![\w.,])(\d+ min \d+ s|\d{1,3}(?:,\d{3})+|\d+\.\d+x?|\d+x|\d+%)(?![\w.]|,\d)")
NOT_FIGURES = {"1x", "100%"}  # TRL's own column against itself
LINK = re.compile(r"\]\((docs/results/[\w/.-]+\.md)(?:#[\w-]+)?\)")


def headline_rows() -> list[list[str]]:
    text = (ROOT / "README.md").read_text()
    section = text.split("## Headline numbers", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("|") and not set(line) <= set("|-: ")]
    return [[cell.strip() for cell in row.strip("|").split("|")] for row in rows[1:]]


RANGE = re.compile(r"\d+(?:\.\d+)?-\d+(?:\.\d+)?[x%]?")  # a summary of the page's cells (1.5-2.3x), not one of them


def figures(text: str) -> set[str]:
    text = RANGE.sub(" ", text.replace("**", ""))
    return {figure for figure in FIGURE.findall(text) if figure not in NOT_FIGURES}


ROWS = headline_rows()
IDS = [re.sub(r"\W+", "-", row[0][:40]) for row in ROWS]


def test_the_headline_table_is_found():
    assert len(ROWS) >= 8, ROWS
    assert all(len(row) == 5 for row in ROWS), [row[0][:40] for row in ROWS if len(row) != 5]


@pytest.mark.parametrize("index", range(len(ROWS)), ids=IDS)
def test_every_headline_figure_is_on_its_results_page(index):
    row = ROWS[index]
    what, posttrain, trl, conditions, _ = row
    links = LINK.findall(" ".join(row))
    if not links and index:  # a row that continues the one above ("the same, beside the test suite")
        links = LINK.findall(" ".join(ROWS[index - 1]))
    assert links, f"{what[:60]}: link the results page that holds this measurement"
    page = "\n".join((ROOT / link).read_text() for link in links).replace("**", "")
    missing = sorted(figure for figure in figures(" ".join([posttrain, trl, conditions])) if figure not in page)
    assert not missing, f"{what[:60]}: not on {links}: {missing}"


@pytest.mark.parametrize("index", range(len(ROWS)), ids=IDS)
def test_every_headline_row_states_its_conditions_and_commit(index):
    what, _, _, conditions, recorded = ROWS[index]
    assert re.search(r"\b(quiet|loaded|load \d|one core|both cores)\b", conditions), f"{what[:60]}: quiet or loaded?"
    runs = r"\b(one run|medians? of \d+|\d+ seeds|mean of \d+)"
    assert re.search(runs, conditions), f"{what[:60]}: how many runs?"
    commit = re.search(r"\b([0-9a-f]{7,40})\b", recorded)
    assert commit, f"{what[:60]}: name the commit that recorded it"
    if not (ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    known = subprocess.run(["git", "-C", str(ROOT), "cat-file", "-e", f"{commit.group(1)}^{{commit}}"])
    assert known.returncode == 0, f"{what[:60]}: commit {commit.group(1)} is not in this repository"


def test_the_figure_reader():
    found = figures("0.0687, 3,091 MB: **1.71x**, 61%; 6 min 31 s; 1x; 2026-12-02; 1.5-2.3x, 69-91%")
    assert found == {"0.0687", "3,091", "1.71x", "61%", "6 min 31 s"}, found
