"""Runs a test's script in a fresh interpreter (what depends on the environment at import time: gc.freeze, oneDNN's
cache capacities) and reads back the JSON it prints on its `RESULT ` line."""

from __future__ import annotations

import json
import subprocess
import sys


def result_of(script: str, args: list[str], env: dict[str, str]) -> dict:
    out = subprocess.run([sys.executable, "-c", script, *args], capture_output=True, text=True, env=env, timeout=600)
    line = next((x for x in out.stdout.splitlines() if x.startswith("RESULT ")), None)
    assert line is not None, out.stderr[-3000:]
    return json.loads(line[len("RESULT ") :])
