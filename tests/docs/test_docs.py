"""Every Python code block in README.md and docs/ runs here, in the default suite.

How (also described for readers in docs/docs_tests.md):
- Each ```python fence is one test, named after its page and line. The blocks of one page share a namespace and run
  in page order, like a notebook; running one block alone first runs the blocks above it on its page.
- The pages show real calls. Under test, `"builtin:SmolLM2-135M-Instruct"` is a tiny Llama with a ChatML tokenizer:
  `POSTTRAIN_CACHE` points at a folder where that tiny model sits under the built-in model's name, so the library's
  own loading code finds it there (its context is widened to 4,096 positions, since the tiny tokenizer spells
  text in about three times as many tokens as SmolLM2's). Every training config built during a block is capped
  (`DOCS_TEST_CAPS`: 2 optimizer steps, short generations) before its own checks run. The blocks run in a scratch
  folder that links the repository's `examples/`, so relative paths on the pages work and outputs land there.
- A block that cannot run here carries `<!-- docs-test: skip <reason> -->` on the line before its fence; the reason
  is the skip message. A block that imports `trl` is skipped when TRL is not installed (fails under CI=1).
"""

from __future__ import annotations

import dataclasses
import json
import re
import shutil
import time
from pathlib import Path

import pytest
from _trl import trl_module

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md"] + sorted((ROOT / "docs").rglob("*.md"))
FENCE = re.compile(r"^(?P<indent>[ \t]*)```(?P<lang>[\w+-]*)\s*$")
SKIP = re.compile(r"<!--\s*docs-test:\s*skip\s+(?P<reason>.+?)\s*-->")
BUILTIN = "SmolLM2-135M-Instruct"

# What a block's training configs are capped to under test (the page shows the real values).
DOCS_TEST_CAPS = {
    "max_steps": 2,
    "max_length": 1024,
    "max_prompt_length": 128,
    "max_completion_length": 8,
    "max_new_tokens": 8,
}


@dataclasses.dataclass
class Block:
    page: Path
    line: int  # the first code line, 1-based
    code: str
    skip: str | None

    @property
    def id(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"


def python_blocks(page: Path) -> list[Block]:
    """The ```python / ```py fences of a markdown page, with the skip marker on the line before each."""
    blocks, lines, index = [], page.read_text(encoding="utf-8").splitlines(), 0
    while index < len(lines):
        opened = FENCE.match(lines[index])
        if not opened or not opened.group("lang"):
            index += 1
            continue
        indent, lang, start = opened.group("indent"), opened.group("lang"), index
        index += 1
        body = []
        while index < len(lines) and not re.match(rf"^{re.escape(indent)}```\s*$", lines[index]):
            body.append(lines[index][len(indent) :] if lines[index].startswith(indent) else lines[index])
            index += 1
        index += 1
        if lang not in ("python", "py"):
            continue
        before = next((lines[j] for j in range(start - 1, -1, -1) if lines[j].strip()), "")
        marker = SKIP.search(before)
        blocks.append(Block(page, start + 2, "\n".join(body) + "\n", marker.group("reason") if marker else None))
    return blocks


BLOCKS = [block for page in PAGES for block in python_blocks(page)]


def test_the_collector_finds_blocks_and_markers(tmp_path):
    page = tmp_path / "page.md"
    page.write_text(
        "# t\n\n```python\nx = 1\n```\n\n<!-- docs-test: skip needs a GPU -->\n```python\ny = 2\n```\n\n"
        "```bash\nls\n```\n\n- item\n\n    ```py\n    z = 3\n    ```\n"
    )
    found = python_blocks(page)
    assert [(b.line, b.code, b.skip) for b in found] == [
        (4, "x = 1\n", None),
        (9, "y = 2\n", "needs a GPU"),
        (19, "z = 3\n", None),
    ]


def test_skips_stay_few_and_say_why():
    skipped = [block for block in BLOCKS if block.skip]
    assert len(BLOCKS) >= 30, len(BLOCKS)
    assert len(skipped) <= max(3, len(BLOCKS) // 8), [block.id for block in skipped]
    assert all(len(block.skip) > 15 for block in skipped), [(block.id, block.skip) for block in skipped]


@pytest.fixture(scope="session")
def docs_workspace(tmp_path_factory, tiny_model_path):
    """The scratch folder the blocks run in, with the tiny model installed under the built-in model's name."""
    root = tmp_path_factory.mktemp("docs")
    cache = root / "posttrain-cache"
    cache.mkdir()
    shutil.copytree(tiny_model_path, cache / BUILTIN)
    config = json.loads((cache / BUILTIN / "config.json").read_text())
    config["max_position_embeddings"] = 4096  # room for the pages' real data under the tiny byte-level tokenizer
    (cache / BUILTIN / "config.json").write_text(json.dumps(config))
    work = root / "work"
    work.mkdir()
    (work / "examples").symlink_to(ROOT / "examples", target_is_directory=True)
    return {"cache": cache, "work": work, "namespaces": {}}


@pytest.fixture()
def docs_environment(docs_workspace, monkeypatch):
    """The environment of one block: the tiny built-in model, capped configs, the scratch folder as cwd."""
    import transformers

    monkeypatch.setenv("POSTTRAIN_CACHE", str(docs_workspace["cache"]))
    monkeypatch.setenv("HF_DATASETS_CACHE", str(docs_workspace["work"] / ".hf-datasets"))
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.chdir(docs_workspace["work"])
    original = transformers.TrainingArguments.__post_init__

    def capped_post_init(self, *args, **kwargs):
        for name, cap in DOCS_TEST_CAPS.items():
            value = getattr(self, name, None)
            if not isinstance(value, int) or isinstance(value, bool):
                continue
            if value > cap or (name == "max_steps" and value < 0):
                setattr(self, name, cap)
        self.disable_tqdm = True
        return original(self, *args, **kwargs)

    monkeypatch.setattr(transformers.TrainingArguments, "__post_init__", capped_post_init)
    return docs_workspace


def _run(block: Block, namespace: dict) -> None:
    if re.search(r"^\s*(from trl\b|import trl\b)", block.code, re.M):
        trl_module("trl", reason="the block imports TRL")
    code = compile("\n" * (block.line - 1) + block.code, str(block.page), "exec")
    exec(code, namespace)


@pytest.mark.parametrize("block", BLOCKS, ids=[block.id for block in BLOCKS])
def test_docs_block(block, docs_environment):
    if block.skip:
        pytest.skip(block.skip)
    namespaces = docs_environment["namespaces"]
    state = namespaces.setdefault(block.page, {"namespace": {"__name__": "__docs__"}, "done": set()})
    for earlier in python_blocks(block.page):
        if earlier.line >= block.line:
            break
        if earlier.line not in state["done"] and not earlier.skip:
            _run(earlier, state["namespace"])
            state["done"].add(earlier.line)
    started = time.perf_counter()
    _run(block, state["namespace"])
    state["done"].add(block.line)
    assert time.perf_counter() - started < 30, f"{block.id} took over 30 s: keep documentation examples small"


def test_the_api_reference_documents_every_top_level_name():
    """Every name of `posttrain.__all__` has its own `::: posttrain.<name>` entry in docs/reference/."""
    import posttrain

    reference = "\n".join(page.read_text() for page in sorted((ROOT / "docs" / "reference").glob("*.md")))
    entries = set(re.findall(r"^::: posttrain\.(\w+)\s*$", reference, re.M))
    missing = sorted(name for name in posttrain.__all__ if not name.startswith("_") and name not in entries)
    assert not missing, f"add these to a page of docs/reference/: {missing}"


def test_the_readme_links_resolve():
    """README.md is read on GitHub, outside the site's strict build: its relative links must name files that exist."""
    text = (ROOT / "README.md").read_text()
    targets = [t.split("#")[0] for t in re.findall(r"\]\(([^)]+)\)", text) if "://" not in t]
    missing = [t for t in targets if t and not (ROOT / t).exists()]
    assert targets and not missing, missing


def test_every_top_level_name_says_what_it_is_for_and_links_its_page():
    """Each name of `posttrain.__all__` has its own docstring, opening with what it is for (not a call signature),
    that names its documentation page (`docs/<page>.md`, which must exist)."""
    import posttrain

    problems = []
    for name in posttrain.__all__:
        if name.startswith("_"):
            continue
        doc = (getattr(posttrain, name).__doc__ or "").strip()
        if not doc:
            problems.append(f"{name}: no docstring")
            continue
        first = doc.splitlines()[0]
        if re.match(rf"`?{name}\(", first) or len(first.split()) < 5:
            problems.append(f"{name}: the first line should say what it is for, not {first[:60]!r}")
        pages = re.findall(r"\bdocs/[\w/]+\.md\b", doc)
        if not pages:
            problems.append(f"{name}: no link to its page (docs/<page>.md)")
        problems += [f"{name}: {page} does not exist" for page in pages if not (ROOT / page).is_file()]
    assert not problems, "\n".join(problems)
