"""The built documentation site in a real headless browser (the harness of tests/training/test_report_browser.py).

The site is served over HTTP on the loopback address, since the search index is fetched by a web worker, which a
file:// page may not do. It is the one .ci/run built (`POSTTRAIN_DOCS_SITE`, by `bash scripts/docs.sh build`), or,
without it, built here from docs/ with `mkdocs build --strict`. Checked: the index, a trainer page, the API reference
and a results page open without console errors, their images decode, the reference lists GRPOConfig's fields, and
the site search finds "GRPOConfig", and the DPO page's formulas are typeset by the site's own KaTeX.
"""

from __future__ import annotations

import functools
import http.server
import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from test_report_browser import CHROMIUM, Browser

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.skipif(CHROMIUM is None, reason="no chromium (scripts/setup.sh installs it where it can)")


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    built = os.environ.get("POSTTRAIN_DOCS_SITE")
    if built and (Path(built) / "index.html").is_file():
        return Path(built)
    pytest.importorskip("mkdocs", reason="mkdocs is not installed (the docs extra: pip install -e '.[docs]')")
    out = tmp_path_factory.mktemp("site")
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1", "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(out)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return out


@pytest.fixture(scope="module")
def served(site):
    class Quiet(http.server.SimpleHTTPRequestHandler):
        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(Quiet, directory=str(site)))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


@pytest.fixture(scope="module")
def browser(tmp_path_factory):
    opened = Browser(tmp_path_factory.mktemp("profile"))
    yield opened
    opened.close()


def evaluate(browser: Browser, session: str, expression: str, timeout: float = 30):
    result = browser.send(
        "Runtime.evaluate", session, timeout=timeout, expression=expression, awaitPromise=True, returnByValue=True
    )
    assert "exceptionDetails" not in result, result
    return result["result"].get("value")


def images_load(page: dict) -> bool:
    return all(complete and width > 0 and height > 0 for complete, width, height in page["images"])


@pytest.mark.parametrize(
    "path, title",
    [
        ("", "posttrain"),
        ("trainers/grpo/", "GRPO - posttrain"),
        ("reference/trainers/", "Trainers and configs"),
        ("results/time_to_accuracy/", "GRPO time to accuracy"),
    ],
)
def test_pages_open_cleanly(served, browser, path, title):
    page = browser.open(f"{served}/{path}")
    assert page["title"].startswith(title), page["title"]
    assert page["errors"] == [], json.dumps(page["errors"])[:2000]
    assert images_load(page), page["images"]
    if path.startswith("results/"):
        assert len(page["images"]) >= 2  # the plots


def test_the_reference_shows_config_fields(served, browser):
    page = browser.open(f"{served}/reference/trainers/")
    text = evaluate(browser, page["session"], "document.body.innerText")
    for expected in ("GRPOTrainer", "GRPOConfig", "num_generations", "Completions sampled per prompt", "SFTConfig"):
        assert expected in text, expected


def test_search_finds_grpoconfig(served, browser):
    page = browser.open(f"{served}/")
    script = """
    new Promise((resolve) => {
      const input = document.querySelector("input[data-md-component=search-query]");
      input.focus();
      input.value = "GRPOConfig";
      for (const kind of ["input", "keyup"]) input.dispatchEvent(new Event(kind, {bubbles: true}));
      const started = Date.now();
      const poll = () => {
        const links = [...document.querySelectorAll(".md-search-result__item a")].map((a) => a.href);
        if (links.length || Date.now() - started > 20000) {
          resolve({links, meta: document.querySelector(".md-search-result__meta")?.textContent});
        } else {
          setTimeout(poll, 200);
        }
      };
      poll();
    })
    """
    found = evaluate(browser, page["session"], script, timeout=40)
    assert found["links"], found
    assert any("reference/trainers" in link or "trainers/grpo" in link for link in found["links"]), found


def test_the_formulas_are_typeset_offline(served, browser):
    """The DPO page's formulas are rendered by the KaTeX copy the site serves (no network in the browser either):
    KaTeX's elements are there, none of them an error, and no arithmatex source is left untypeset."""
    page = browser.open(f"{served}/trainers/dpo/")
    assert page["errors"] == [], json.dumps(page["errors"])[:2000]
    script = """({
      katex: document.querySelectorAll(".arithmatex .katex").length,
      display: document.querySelectorAll(".arithmatex .katex-display").length,
      errors: document.querySelectorAll(".katex-error").length,
      raw: [...document.querySelectorAll(".arithmatex")].filter((e) => !e.querySelector(".katex")).length,
    })"""
    found = evaluate(browser, page["session"], script)
    assert found["katex"] >= 20 and found["display"] >= 2, found
    assert found["errors"] == 0 and found["raw"] == 0, found
