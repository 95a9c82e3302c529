"""The report of a real run, opened in a real headless browser (Debian's chromium, driven over the DevTools
protocol on a pipe): the page loads, every inline SVG plot lays out with its lines, nothing is logged as an error."""

from __future__ import annotations

import json
import os
import select
import shutil
import subprocess
import time
from pathlib import Path

import pytest
from datasets import Dataset

from posttrain import SFTConfig, SFTTrainer

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")
pytestmark = pytest.mark.skipif(CHROMIUM is None, reason="no chromium (scripts/setup.sh installs it where it can)")


class Browser:
    """A headless chromium spoken to over --remote-debugging-pipe (commands on fd 3, replies on fd 4)."""

    def __init__(self, profile: Path):
        to_browser_read, self._to_browser = os.pipe()
        self._from_browser, from_browser_write = os.pipe()

        def wire_pipes():  # runs in the child: the protocol fixes fds 3 and 4
            os.dup2(to_browser_read, 100)  # out of the way first, in case either pipe end is fd 3 or 4
            os.dup2(from_browser_write, 101)
            os.dup2(100, 3)
            os.dup2(101, 4)

        self.process = subprocess.Popen(
            [
                CHROMIUM,
                "--headless=new",
                "--no-sandbox",
                "--disable-gpu",
                "--no-first-run",
                "--disable-extensions",
                "--disable-background-networking",  # no update checks, safe browsing or other calls out
                "--disable-component-update",
                "--disable-sync",
                "--no-default-browser-check",
                "--remote-debugging-pipe",
                f"--user-data-dir={profile}",
                "about:blank",
            ],
            preexec_fn=wire_pipes,
            close_fds=False,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        os.close(to_browser_read)
        os.close(from_browser_write)
        self._buffer, self._next_id, self.events = b"", 0, []

    def send(self, method: str, session: str | None = None, timeout: float = 30, **params) -> dict:
        self._next_id += 1
        message = {"id": self._next_id, "method": method, "params": params}
        if session:
            message["sessionId"] = session
        os.write(self._to_browser, json.dumps(message).encode() + b"\0")
        reply = self.wait(lambda m: m.get("id") == self._next_id, timeout)
        assert "error" not in reply, (method, reply["error"])
        return reply.get("result", {})

    def wait(self, matches, timeout: float = 30) -> dict:
        """Reads messages until one `matches`; events read on the way are kept in `events`."""
        deadline = time.monotonic() + timeout
        while True:
            while b"\0" in self._buffer:
                raw, self._buffer = self._buffer.split(b"\0", 1)
                message = json.loads(raw)
                if "method" in message:
                    self.events.append(message)
                if matches(message):
                    return message
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([self._from_browser], [], [], left)[0]:
                raise TimeoutError("chromium did not answer in time")
            chunk = os.read(self._from_browser, 1 << 16)
            if not chunk:
                raise RuntimeError("chromium closed the pipe")
            self._buffer += chunk

    def open(self, url: str) -> dict:
        """Loads `url` in a fresh tab; returns what the page shows and every error it raised."""
        target = self.send("Target.createTarget", url="about:blank")["targetId"]
        session = self.send("Target.attachToTarget", targetId=target, flatten=True)["sessionId"]
        for domain in ("Page", "Runtime", "Log"):
            self.send(f"{domain}.enable", session)
        self.send("Page.navigate", session, url=url)
        self.wait(lambda m: m.get("method") == "Page.loadEventFired" and m.get("sessionId") == session)
        script = (
            "JSON.stringify({title: document.title, h2: [...document.querySelectorAll('h2')].map(h => "
            "h.textContent), images: [...document.images].map(i => [i.complete, i.naturalWidth, "
            "i.naturalHeight]), svgs: [...document.querySelectorAll('svg')].map(s => {const r = "
            "s.getBoundingClientRect(); return [r.width, r.height, s.querySelectorAll('polyline').length, "
            "[...s.querySelectorAll('polyline')].every(p => p.points.length > 0 && p.getTotalLength() >= 0)]})})"
        )
        page = json.loads(
            self.send("Runtime.evaluate", session, expression=script, returnByValue=True)["result"]["value"]
        )
        self.send("Runtime.evaluate", session, expression="1")  # lets queued console events arrive first
        page["session"] = session
        page["errors"] = [
            event
            for event in self.events
            if event.get("sessionId") == session
            and (
                event["method"] == "Runtime.exceptionThrown"
                or (event["method"] == "Runtime.consoleAPICalled" and event["params"]["type"] in ("error", "assert"))
                or (event["method"] == "Log.entryAdded" and event["params"]["entry"]["level"] == "error")
            )
        ]
        return page

    def close(self):
        try:
            self.send("Browser.close", timeout=10)
        except (TimeoutError, RuntimeError, OSError):
            pass
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.process.kill()
        os.close(self._to_browser)
        os.close(self._from_browser)


@pytest.fixture()
def browser(tmp_path):
    opened = Browser(tmp_path / "profile")
    yield opened
    opened.close()


def test_the_harness_sees_broken_images_and_console_errors(tmp_path, browser):
    """The check below can fail: a page with a broken image and a script error is caught."""
    page = tmp_path / "broken.html"
    page.write_text(
        '<!DOCTYPE html><title>t</title><img src="data:image/png;base64,AAAA">'
        '<script>console.error("boom"); undefined_function();</script>'
    )
    seen = browser.open(page.as_uri())
    assert seen["images"] == [[True, 0, 0]]
    kinds = sorted(event["method"] for event in seen["errors"])
    assert "Runtime.consoleAPICalled" in kinds and "Runtime.exceptionThrown" in kinds


def test_a_python_api_run_report_renders_in_a_browser(tmp_path, tiny_model_path, browser):
    rows = [{"prompt": f"{i} plus 1 is", "completion": f" {i + 1}"} for i in range(12)]
    args = SFTConfig(
        output_dir=str(tmp_path / "out"),
        per_device_train_batch_size=4,
        max_steps=3,
        logging_steps=2,
        save_strategy="no",
        report_to="none",
        use_cpu=True,
        bf16=False,
        max_length=32,
        disable_tqdm=True,
    )
    SFTTrainer(tiny_model_path, args=args, train_dataset=Dataset.from_list(rows)).train()
    plots = sorted(path.name for path in (tmp_path / "out").glob("plot_*.svg"))
    assert "plot_loss.svg" in plots
    seen = browser.open((tmp_path / "out" / "report.html").as_uri())
    assert seen["title"] == "SFT run: out"
    assert seen["h2"] == ["Summary", "Plots"]
    assert seen["images"] == []
    assert len(seen["svgs"]) == len(plots)
    assert all(width > 0 and height > 0 and lines > 0 and drawn for width, height, lines, drawn in seen["svgs"]), seen
    # A saved plot file opens on its own too (it carries the SVG namespace).
    alone = browser.open((tmp_path / "out" / "plot_loss.svg").as_uri())
    assert len(alone["svgs"]) == 1 and alone["svgs"][0][2] > 0 and alone["errors"] == []
    assert seen["errors"] == []
