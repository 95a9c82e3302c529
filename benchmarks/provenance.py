"""What a measurement needs to be trusted later (issue 44): the commit it measured, whether the tree had changes,
when, and how loaded the machine was. Every benchmark result that goes to JSON carries these; every table header
prints them.

    from provenance import conditions
    result = {**measurements, "conditions": conditions()}
"""

from __future__ import annotations

import datetime
import os
import subprocess
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent


def git_commit(root: Path = REPO_ROOT) -> str:
    """`git rev-parse HEAD` of the repository, "+dirty" appended when tracked files differ from it; "unknown"
    outside a git checkout (an installed copy)."""
    try:
        head = subprocess.run(
            ["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True, check=True, timeout=30
        ).stdout.strip()
        changed = subprocess.run(
            ["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
            capture_output=True,
            text=True,
            check=True,
            timeout=30,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return head + ("+dirty" if changed else "")


def conditions() -> dict:
    """The commit, the UTC time, the load average (1, 5, 15 min) and the CPU count, as JSON-ready values."""
    return {
        "commit": git_commit(),
        "utc": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%S"),
        "load_average": [round(value, 2) for value in os.getloadavg()],
        "cpus": os.cpu_count(),
    }


def describe(info: dict) -> str:
    """One line for a table header: "commit 1a2b3c4 (+dirty), 2026-12-07 15:00:00 UTC, load 1.2"."""
    commit = info["commit"]
    short = commit[:7] + (" +dirty" if commit.endswith("+dirty") else "") if commit != "unknown" else commit
    return f"commit {short}, {info['utc']} UTC, load {info['load_average'][0]:.1f}"
