"""Every trainer page teaches its method with the math (issue 44), and its loss-type tables follow the code.

- Each trainer page and each experimental family's page has at least one display formula (`$$` block, rendered by
  pymdownx.arithmatex and the KaTeX copy the site serves) and a "What it optimises" section.
- A loss-type table is a table whose first header cell names it (`loss_type`, `CPO loss_type`, ...); the names in
  its first column are exactly the types the code accepts, read here from the code at test time: DPO's
  `DPO_LOSSES`, GRPO's loss-type registry in `posttrain.losses.policy`, the other configs' `loss_type` choices.
- Formulas are balanced: no `$$` left open, and the KaTeX assets the pages load are in docs/.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from collections.abc import Mapping
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
TRAINER_PAGES = sorted((DOCS / "trainers").glob("*.md"))
FAMILY_PAGES = [
    DOCS / "experimental" / name
    for name in ("offline_preference.md", "online_preference.md", "grpo_family.md", "distillation.md", "prm.md")
]


def grpo_loss_types() -> set[str]:
    """The loss types of GRPO's registry in posttrain.losses.policy: its largest module-level mapping or tuple of
    names that holds "grpo" and "cispo" (a dict's keys are the names)."""
    import posttrain.losses.policy as policy

    candidates = []
    for name, value in vars(policy).items():
        if name.startswith("__") or isinstance(value, (str, bytes)):
            continue
        if isinstance(value, Mapping):
            names = list(value)
        elif isinstance(value, (tuple, list, frozenset, set)):
            names = list(value)
        else:
            continue
        if all(isinstance(item, str) for item in names) and {"grpo", "cispo"} <= set(names):
            candidates.append(set(names))
    assert candidates, "no loss-type registry with 'grpo' and 'cispo' in posttrain/losses/policy.py"
    return max(candidates, key=len)


def choices(config: str, field: str = "loss_type") -> set[str]:
    """The values a config's field accepts (its declared `choices`)."""
    import posttrain
    from posttrain.training.fields import declared_rules

    if "." in config:
        module, name = config.rsplit(".", 1)
        klass = getattr(__import__(module, fromlist=[name]), name)
    else:
        klass = getattr(posttrain, config)
    return set(declared_rules(klass)[field][0]["choices"])


def dpo_loss_types() -> set[str]:
    from posttrain.losses.dpo_types import DPO_LOSSES

    return set(DPO_LOSSES)


def kto_loss_types() -> set[str]:
    from posttrain.losses.preference import KTO_LOSS_TYPES

    return set(KTO_LOSS_TYPES)


def tpo_loss_types() -> set[str]:
    from posttrain.losses.tpo import TPO_LOSS_TYPES

    return set(TPO_LOSS_TYPES)


# page -> {first header cell of the table: what the code accepts}
LOSS_TABLES = {
    "trainers/dpo.md": {"loss_type": dpo_loss_types},
    "trainers/grpo.md": {"loss_type": grpo_loss_types},
    "trainers/sft.md": {"loss_type": lambda: choices("SFTConfig")},
    "trainers/kto.md": {"loss_type": kto_loss_types},
    "trainers/rloo.md": {"loss_type": lambda: choices("RLOOConfig")},
    "experimental/offline_preference.md": {
        "CPO loss_type": lambda: choices("posttrain.experimental.cpo.CPOConfig"),
        "TPO loss_type": tpo_loss_types,
    },
}


def tables(text: str) -> dict[str, list[str]]:
    """Each markdown table's first header cell -> the backticked names in its rows' first cells."""
    found, lines, index = {}, text.splitlines(), 0
    while index < len(lines):
        line = lines[index]
        if line.startswith("|") and index + 1 < len(lines) and re.match(r"^\|[-:| ]+\|$", lines[index + 1]):
            header = line.strip("|").split("|")[0].strip().replace("`", "")
            rows, index = [], index + 2
            while index < len(lines) and lines[index].startswith("|"):
                rows += re.findall(r"`([\w.-]+)`", lines[index].strip("|").split("|")[0])
                index += 1
            found.setdefault(header, rows)
            continue
        index += 1
    return found


def test_the_table_reader(tmp_path):
    text = "x\n\n| loss_type | f |\n|---|---|\n| `a` | $x$ |\n| `b`, `c-d` | y |\n\nz\n"
    assert tables(text) == {"loss_type": ["a", "b", "c-d"]}


@pytest.mark.parametrize("page", TRAINER_PAGES + FAMILY_PAGES, ids=lambda page: str(page.relative_to(DOCS)))
def test_every_trainer_page_has_its_math(page):
    text = page.read_text()
    blocks = re.findall(r"^\s*\$\$\n(.+?)\n\s*\$\$\s*$", text, re.S | re.M)
    assert blocks, f"{page.name}: no display formula ($$ ... $$ block)"
    assert text.count("$$") % 2 == 0, f"{page.name}: a $$ block is left open"
    assert re.search(r"^## What it optimises", text, re.M), f"{page.name}: no '## What it optimises' section"


OTHER_SECTIONS = r"(What it optimises|Tips|See also|Logged|Data|Example|Differences|Key options|Minimal|Results|Which)"


def test_every_family_page_has_a_formula_per_method():
    """The experimental families' pages: every method section (## heading) that trains has a formula."""
    for page in FAMILY_PAGES:
        sections = re.split(r"^## ", page.read_text(), flags=re.M)[1:]
        methods = [s for s in sections if not re.match(OTHER_SECTIONS, s)]
        missing = [s.splitlines()[0] for s in methods if "$" not in s]
        assert not missing, f"{page.name}: sections without a formula: {missing}"


@pytest.mark.parametrize("page", sorted(LOSS_TABLES))
def test_loss_type_tables_list_exactly_what_the_code_accepts(page):
    found = tables((DOCS / page).read_text())
    for header, accepted in LOSS_TABLES[page].items():
        assert header in found, f"{page}: no table headed '{header}'"
        listed, expected = found[header], accepted()
        assert len(listed) == len(set(listed)), f"{page}: a type listed twice in '{header}': {listed}"
        missing, extra = sorted(expected - set(listed)), sorted(set(listed) - expected)
        assert not missing and not extra, f"{page} '{header}': missing {missing}, not accepted by the code {extra}"


def test_the_site_serves_katex_itself():
    text = (ROOT / "mkdocs.yml").read_text()  # read as text: mkdocs.yml may hold !!python tags
    scripts = re.findall(r"^\s*-\s*(\S+\.js)\s*$", text, re.M)
    styles = re.findall(r"^\s*-\s*(\S+\.css)\s*$", text, re.M)
    assert any("katex.min.js" in s for s in scripts) and any("katex.min.css" in s for s in styles)
    for path in scripts + styles:
        assert "://" not in path, f"{path}: the site must not load anything from the network"
        assert (DOCS / path).is_file(), path
    fonts = list((DOCS / "assets" / "katex" / "fonts").glob("*.woff2"))
    assert len(fonts) >= 15, fonts
    css = (DOCS / "assets" / "katex" / "katex.min.css").read_text()
    assert "://" not in css.replace("http://www.w3.org", "")


def formulas(text: str) -> list[tuple[str, bool]]:
    """(TeX, display) of every formula of a markdown page, code blocks and code spans left out."""
    text = re.sub(r"^(\s*)```.*?^\1```", "", text, flags=re.S | re.M)
    text = re.sub(r"`[^`\n]*`", "", text)
    found = [(body.strip(), True) for body in re.findall(r"\$\$(.+?)\$\$", text, re.S)]
    text = re.sub(r"\$\$(.+?)\$\$", "", text, flags=re.S)
    return found + [(body, False) for body in re.findall(r"\$([^$\n]+?)\$", text)]


@pytest.mark.skipif(shutil.which("node") is None, reason="no node to run the site's KaTeX copy")
def test_every_formula_renders_with_the_sites_katex(tmp_path):
    """Each formula of the docs through docs/assets/katex/katex.min.js with throwOnError: a TeX typo fails here
    instead of showing red on the page."""
    items = [
        {"page": str(page.relative_to(ROOT)), "tex": tex, "display": display}
        for page in [ROOT / "README.md", *sorted(DOCS.rglob("*.md"))]
        for tex, display in formulas(page.read_text())
    ]
    assert len(items) >= 100, len(items)
    (tmp_path / "items.json").write_text(json.dumps(items))
    script = tmp_path / "render.js"
    script.write_text(
        f"const katex = require({json.dumps(str(DOCS / 'assets' / 'katex' / 'katex.min.js'))});\n"
        f"const items = require({json.dumps(str(tmp_path / 'items.json'))});\n"
        "const bad = [];\n"
        "for (const item of items) {\n"
        "  try { katex.renderToString(item.tex, {displayMode: item.display, throwOnError: true}); }\n"
        "  catch (error) { bad.push(item.page + ': ' + error.message.slice(0, 160)); }\n"
        "}\n"
        "console.log(JSON.stringify(bad));\n"
    )
    done = subprocess.run(["node", str(script)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    bad = json.loads(done.stdout)
    assert not bad, "\n".join(bad)


def test_the_formula_reader():
    text = "a $x_1$ and `$not$`\n\n```python\ny = '$no$'\n```\n\n$$\n\\frac12\n$$\n"
    assert formulas(text) == [("\\frac12", True), ("x_1", False)]


def test_the_paper_index_lists_every_paper_the_trainer_pages_cite():
    cited = set()
    for page in TRAINER_PAGES + FAMILY_PAGES:
        cited |= set(re.findall(r"arxiv\.org/abs/(\d{4}\.\d{4,5})", page.read_text()))
    index = set(re.findall(r"arxiv\.org/abs/(\d{4}\.\d{4,5})", (DOCS / "papers.md").read_text()))
    assert len(cited) >= 40, len(cited)
    assert not cited - index, f"add to docs/papers.md: {sorted(cited - index)}"
