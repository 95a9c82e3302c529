"""The git commit a package was installed from, when it runs from a source checkout."""

from __future__ import annotations

import importlib.util
import subprocess
from pathlib import Path


def get_git_commit_hash(package_name: str) -> str | None:
    """The HEAD commit of the git checkout `package_name` is imported from (an editable or source install), or None
    (not installed, installed from a wheel, or git unavailable)."""
    spec = importlib.util.find_spec(package_name)
    if spec is None or not spec.origin:
        return None
    origin = Path(spec.origin).resolve()

    def git(*args: str) -> subprocess.CompletedProcess | None:
        try:
            return subprocess.run(["git", *args], cwd=origin.parent, capture_output=True, text=True, timeout=10)
        except (OSError, subprocess.TimeoutExpired):
            return None

    tracked = git("ls-files", "--error-unmatch", origin.name)  # a file of the checkout, not one inside its venv
    head = git("rev-parse", "HEAD") if tracked is not None and tracked.returncode == 0 else None
    return head.stdout.strip() if head is not None and head.returncode == 0 else None


__all__ = ["get_git_commit_hash"]
