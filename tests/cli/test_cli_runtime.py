"""The `posttrain` launcher's process set-up: allocator preload by re-execution, threads, and `posttrain env`."""

from __future__ import annotations

import glob
import json
import os
import subprocess
import sys

import pytest

from posttrain.cli import runtime
from posttrain.runtime.cores import generation_core_split

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
if "FAKE_BUSY" in os.environ:  # what busy_cores would have seen
    runtime.busy_cores = lambda: int(os.environ["FAKE_BUSY"])
runtime.prepare_training_process(sys.argv[1:])
print(json.dumps({"path": None, "threads": os.environ.get("OMP_NUM_THREADS")}))
"""


def _probe(args, **env):
    base = {
        k: v
        for k, v in os.environ.items()
        if k not in ("LD_PRELOAD", "OMP_NUM_THREADS", "OMP_WAIT_POLICY", runtime.ALLOCATOR_ENV, runtime.REEXEC_ENV)
    }
    env = {"FAKE_BUSY": "0", **env}  # the machine's load must not change the expected threads
    done = subprocess.run(
        [sys.executable, "-c", PROBE, *args], env={**base, **env}, capture_output=True, text=True, check=True
    )
    return dict(json.loads(done.stdout.strip().splitlines()[-1]), stderr=done.stderr)


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
    real_glob = glob.glob
    monkeypatch.setattr(
        glob,
        "glob",
        lambda pattern: real_glob(pattern.replace("/sys/devices/system/cpu/", f"{tmp_path}/").replace("/topology", "")),
    )
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


def _stat(rows: dict[int, tuple[int, int]]) -> str:
    """/proc/stat text with the given (busy, idle) jiffies per CPU (user = busy, idle split idle / iowait)."""
    lines = ["cpu  1 2 3 4 5 6 7 8 0 0"]
    lines += [f"cpu{cpu} {busy} 0 0 {idle - idle // 4} {idle // 4} 0 0 0 0 0" for cpu, (busy, idle) in rows.items()]
    return "\n".join(lines + ["intr 1 2 3", "ctxt 9"]) + "\n"


def test_busy_cores_counts_the_cores_other_work_keeps_busy(monkeypatch, tmp_path):
    path = tmp_path / "stat"
    path.write_text(_stat({0: (100, 900), 1: (500, 500), 2: (0, 0), 3: (7, 7)}))
    before = runtime.cpu_times(str(path))
    assert before == {0: (1000, 900), 1: (1000, 500), 2: (0, 0), 3: (14, 7)}
    # Over the look: CPU 0 80% busy, CPU 1 70%, CPU 2 100%, CPU 3 idle.
    path.write_text(_stat({0: (180, 920), 1: (570, 530), 2: (50, 0), 3: (7, 57)}))
    after = runtime.cpu_times(str(path))
    monkeypatch.setattr(runtime, "_cores_of_cpus", lambda: {0: "0", 1: "1", 2: "2", 3: "3"})
    assert runtime.busy_cores(before, after) == 2  # CPUs 0 and 2 (BUSY_SHARE 0.75)
    monkeypatch.setattr(runtime, "_cores_of_cpus", lambda: {0: "0,2", 2: "0,2", 1: "1", 3: "3"})
    assert runtime.busy_cores(before, after) == 1  # two busy hyper-threads of one core
    monkeypatch.setattr(runtime, "_cores_of_cpus", lambda: {1: "1", 3: "3"})  # affinity: the others only
    assert runtime.busy_cores(before, after) == 0
    assert runtime.cpu_times(str(tmp_path / "missing")) == {}


def test_threads_leave_the_busy_cores_to_the_other_work(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(runtime, "physical_cores", lambda: 8)
    assert runtime.thread_settings(1, busy=0)["OMP_NUM_THREADS"] == "8"
    assert runtime.thread_settings(1, busy=3)["OMP_NUM_THREADS"] == "5"
    assert runtime.thread_settings(2, busy=3)["OMP_NUM_THREADS"] == "2"
    assert runtime.thread_settings(1, busy=8)["OMP_NUM_THREADS"] == "1"  # never none
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert "OMP_NUM_THREADS" not in runtime.thread_settings(1, busy=5)


@pytest.mark.skipif(runtime.physical_cores() < 2, reason="needs two cores")
def test_a_training_command_says_when_it_leaves_cores_to_other_work():
    out = _probe(["sft"], FAKE_BUSY="1", **{runtime.ALLOCATOR_ENV: "system"})
    assert out["threads"] == str(runtime.physical_cores() - 1)
    assert "other work keeps 1 of the" in out["stderr"] and "OMP_NUM_THREADS" in out["stderr"]
    assert "other work" not in _probe(["sft"], **{runtime.ALLOCATOR_ENV: "system"})["stderr"]


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two CPUs")
def test_busy_cores_sees_a_busy_loop_on_another_cpu():
    """A real neighbour: a Python busy loop pinned to one of our CPUs for the whole look."""
    cpu = max(os.sched_getaffinity(0))
    code = f"import os, time\nos.sched_setaffinity(0, {{{cpu}}})\nend = time.time() + 3\nwhile time.time() < end: pass"
    neighbour = subprocess.Popen([sys.executable, "-c", code])
    try:
        import time

        time.sleep(0.5)  # started and pinned
        assert runtime.busy_cores() >= 1
    finally:
        neighbour.kill()


def test_generation_gets_half_the_free_cores_and_siblings_stay_together():
    # Two physical cores of two hyper-threads each: one core (both its CPUs) per side, one thread each.
    split = generation_core_split({"0,2": [0, 2], "1,3": [1, 3]})
    assert (split.generation, split.training) == ((0, 2), (1, 3))
    assert (split.generation_threads, split.training_threads) == (1, 1)
    five = {str(core): [core] for core in range(5)}
    split = generation_core_split(five)
    assert (split.generation, split.training) == ((0, 1), (2, 3, 4))  # half, rounded down, to generation
    assert generation_core_split(five, generation_cores=4).training == (4,)
    # One free core, or a request that leaves a side without one: no split (the thread producer instead).
    assert generation_core_split({"0": [0]}) is None
    assert generation_core_split(five, generation_cores=5) is None
    assert generation_core_split(five, generation_cores=0) is None


def test_env_shows_the_asynchronous_generation_split(monkeypatch):
    from posttrain.cli import environment

    def split_line() -> str:
        lines = environment.environment_report(optional={}).splitlines()
        return next(line for line in lines if line.startswith("async split")).removeprefix("async split").strip()

    monkeypatch.setattr(environment, "free_cores", lambda: {"0": [0], "1": [1]})
    assert split_line() == (
        "generation 1 core(s) (CPUs 0), training 1 core(s) (CPUs 1) (async_generation_rounds >= 1, free cores now)"
    )
    monkeypatch.setattr(environment, "free_cores", lambda: {"0": [0]})
    assert split_line().startswith("none: 1 free core(s)")
