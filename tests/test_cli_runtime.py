"""The `posttrain` launcher's process set-up: allocator preload by re-execution, threads, and `posttrain env`."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from posttrain.cli import runtime

# Runs prepare_training_process in a fresh interpreter (no torch imported) with os.execve replaced by a recorder.
PROBE = """
import json, os, sys
from posttrain.cli import runtime
def record(path, args, env):
    print(json.dumps({"path": path, "args": args, "preload": env.get("LD_PRELOAD"),
                      "reexec": env.get(runtime.REEXEC_ENV), "threads": env.get("OMP_NUM_THREADS"),
                      "wait": env.get("OMP_WAIT_POLICY")}))
    sys.exit(0)
os.execve = record
runtime.prepare_training_process(sys.argv[1:])
print(json.dumps({"path": None, "threads": os.environ.get("OMP_NUM_THREADS")}))
"""


def _probe(args, **env):
    base = {k: v for k, v in os.environ.items()
            if k not in ("LD_PRELOAD", "OMP_NUM_THREADS", "OMP_WAIT_POLICY", runtime.ALLOCATOR_ENV, runtime.REEXEC_ENV)}
    done = subprocess.run([sys.executable, "-c", PROBE, *args], env={**base, **env}, capture_output=True, text=True,
                          check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


needs_allocator = pytest.mark.skipif(runtime.find_allocator() is None, reason="no tcmalloc/jemalloc installed")


@needs_allocator
def test_a_training_command_reexecutes_itself_with_the_allocator_preloaded():
    out = _probe(["sft", "--num_processes", "2"], LD_PRELOAD="")
    assert out["path"] == sys.executable
    assert out["args"] == [sys.executable, "-m", "posttrain", "sft", "--num_processes", "2"]
    assert out["preload"] == runtime.find_allocator() and out["reexec"] == "1"
    assert out["threads"] == str(max(1, runtime.physical_cores() // 2)) and out["wait"] == "PASSIVE"


def test_no_reexecution_when_opted_out_already_done_or_set_by_the_user():
    assert _probe(["sft"], **{runtime.ALLOCATOR_ENV: "system"})["path"] is None
    assert _probe(["sft"], **{runtime.REEXEC_ENV: "1"})["path"] is None
    assert _probe(["sft"], **{runtime.ALLOCATOR_ENV: "/no/such/libtcmalloc.so"})["path"] is None
    assert _probe(["sft"], OMP_NUM_THREADS="3", **{runtime.ALLOCATOR_ENV: "system"})["threads"] == "3"


@needs_allocator
def test_a_preloaded_allocator_is_seen_in_the_process():
    code = "from posttrain.cli.runtime import loaded_allocator; print(loaded_allocator())"
    env = {**os.environ, "LD_PRELOAD": runtime.find_allocator()}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    assert os.path.realpath(out.strip()) == os.path.realpath(runtime.find_allocator())
    env["LD_PRELOAD"] = ""
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    assert out.strip() == "None"


def test_physical_cores_counts_hyperthread_siblings_once(monkeypatch, tmp_path):
    # Four logical CPUs, two cores of two hyper-threads each.
    siblings = {0: "0,2", 1: "1,3", 2: "0,2", 3: "1,3"}
    for cpu, text in siblings.items():
        (tmp_path / f"cpu{cpu}").mkdir()
        (tmp_path / f"cpu{cpu}" / "thread_siblings_list").write_text(text + "\n")
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3})
    real_glob = runtime.glob.glob
    monkeypatch.setattr(runtime.glob, "glob", lambda pattern: real_glob(
        pattern.replace("/sys/devices/system/cpu/", f"{tmp_path}/").replace("/topology", "")))
    assert runtime.physical_cores() == 2
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 2})  # both threads of one core
    assert runtime.physical_cores() == 1


def test_env_reports_allocator_and_threads(monkeypatch):
    from posttrain.cli.environment import environment_report

    monkeypatch.setenv(runtime.ALLOCATOR_ENV, "system")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    lines = dict(line.split(None, 1) for line in environment_report(optional={}).splitlines())
    assert lines["allocator"].startswith(f"training: glibc malloc ({runtime.ALLOCATOR_ENV}=system)")
    assert lines["threads"].startswith("1 (OMP_NUM_THREADS) of ")
