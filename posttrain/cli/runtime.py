"""Process set-up for the `posttrain` command, before torch is imported: a faster memory allocator and the
compute thread count.

- Allocator: glibc's malloc returns freed activation and gradient buffers to the kernel and faults them in
  again on every step; tcmalloc (or jemalloc) keeps them, which on CPU training is faster and peaks lower. When
  one is installed (Debian/Ubuntu: `apt-get install libtcmalloc-minimal4` or `libjemalloc2`) and not already
  loaded, a training command re-executes itself once with it in LD_PRELOAD (an allocator cannot be swapped in
  after the process has started). POSTTRAIN_ALLOCATOR=system turns this off; a path chooses the library.
- Threads: OMP_NUM_THREADS, when unset, becomes the number of physical cores this process may run on (hyper-
  threads only contend for the same units) that other work is not keeping busy, divided among the processes of a
  multi-process run. A core counts as busy when it was at least BUSY_SHARE busy over a short look at /proc/stat
  before training: an OpenMP thread on such a core gets a fraction of it, and every parallel region waits for
  that thread, so on 2 cores with one taken two threads run slower than one. Idle OpenMP threads sleep instead
  of spinning (OMP_WAIT_POLICY=PASSIVE, when unset), so that a waiting thread does not burn the core another job
  or this run's own next op needs.
"""

from __future__ import annotations

import os
import sys
import time

from posttrain.runtime.cores import BUSY_LOOK_S, BUSY_SHARE, busy_core_ids, cpu_times
from posttrain.runtime.cores import cores_of_cpus as _cores_of_cpus

ALLOCATOR_ENV = "POSTTRAIN_ALLOCATOR"  # "system" (no preload), or a library path to preload
REEXEC_ENV = "POSTTRAIN_ALLOCATOR_REEXEC"  # set in the re-executed process: never re-execute twice
# In order of preference; each as found in the usual library directories.
ALLOCATOR_NAMES = ("libtcmalloc_minimal.so.4", "libtcmalloc.so.4", "libjemalloc.so.2")
LIBRARY_DIRS = (
    "/usr/lib/x86_64-linux-gnu",
    "/lib/x86_64-linux-gnu",
    "/usr/lib/aarch64-linux-gnu",
    "/lib/aarch64-linux-gnu",
    "/usr/lib64",
    "/usr/lib",
    "/usr/local/lib",
)


def find_allocator() -> str | None:
    """The allocator library to preload: POSTTRAIN_ALLOCATOR's path, else the first installed of tcmalloc /
    jemalloc; None when none is installed or POSTTRAIN_ALLOCATOR=system."""
    chosen = os.environ.get(ALLOCATOR_ENV, "").strip()
    if chosen.lower() in ("system", "glibc", "none", "0", "off"):
        return None
    if chosen:
        return chosen if os.path.exists(chosen) else None
    for name in ALLOCATOR_NAMES:
        for directory in LIBRARY_DIRS:
            path = os.path.join(directory, name)
            if os.path.exists(path):
                return path
    return None


def loaded_allocator() -> str | None:
    """The tcmalloc / jemalloc library mapped into this process (preloaded or linked), or None (glibc malloc)."""
    try:
        with open("/proc/self/maps", encoding="utf-8") as maps:
            for line in maps:
                path = line.rsplit(None, 1)[-1]
                if "tcmalloc" in path or "jemalloc" in path:
                    return path
    except OSError:
        pass
    return None


def physical_cores() -> int:
    """Physical cores among the CPUs this process may run on (its affinity mask): hyper-thread siblings count once."""
    return max(1, len(set(_cores_of_cpus().values())))


def busy_cores(
    before: dict[int, tuple[int, int]] | None = None, after: dict[int, tuple[int, int]] | None = None
) -> int:
    """Physical cores of this process that other work kept at least BUSY_SHARE busy between two `cpu_times`
    snapshots (taken BUSY_LOOK_S apart when not given); a core counts once any of its hyper-threads is busy."""
    if before is None or after is None:
        before = cpu_times()
        time.sleep(BUSY_LOOK_S)
        after = cpu_times()
    return len(busy_core_ids(before, after, _cores_of_cpus(), BUSY_SHARE))


def busy_now() -> int:
    """`busy_cores()`, looked at only when OMP_NUM_THREADS leaves the thread count to us (0 otherwise)."""
    return busy_cores() if "OMP_NUM_THREADS" not in os.environ else 0


def thread_settings(num_processes: int = 1, busy: int = 0) -> dict[str, str]:
    """The OpenMP variables to set where the user has not: threads = the physical cores other work leaves free
    (all but `busy`; at least 1), shared among the processes; passive waiting."""
    settings = {}
    if "OMP_NUM_THREADS" not in os.environ:
        cores = physical_cores()
        free = cores - min(busy, cores - 1)
        settings["OMP_NUM_THREADS"] = str(max(1, free // max(1, num_processes)))
    if "OMP_WAIT_POLICY" not in os.environ:
        settings["OMP_WAIT_POLICY"] = "PASSIVE"
    return settings


def _num_processes(argv: list[str]) -> int:
    """--num_processes N from the command line (before the flags are parsed), 1 when absent or unreadable."""
    for i, token in enumerate(argv):
        value = (
            token.split("=", 1)[1]
            if token.startswith("--num_processes=")
            else (argv[i + 1] if token == "--num_processes" and i + 1 < len(argv) else None)
        )
        if value is not None:
            try:
                return max(1, int(value))
            except ValueError:
                return 1
    return 1


def prepare_training_process(argv: list[str]) -> None:
    """Sets the thread variables and, when an allocator is to be preloaded and is not, re-executes this command
    with it (the call does not return then). `argv`: the command's arguments after the program name."""
    processes = _num_processes(argv)
    busy = busy_now()
    settings = thread_settings(processes, busy)
    if busy and physical_cores() > 1:
        print(
            f"posttrain: other work keeps {busy} of the {physical_cores()} cores busy; training with "
            f"{settings['OMP_NUM_THREADS']} thread(s) per process (OMP_NUM_THREADS sets it)",
            file=sys.stderr,
        )
    os.environ.update(settings)
    if os.environ.get(REEXEC_ENV) or "torch" in sys.modules:
        return  # already re-executed (even if the preload failed), or too late: torch has its allocator
    library = find_allocator()
    if library is None or loaded_allocator() is not None:
        return
    env = dict(os.environ, LD_PRELOAD=":".join(p for p in (library, os.environ.get("LD_PRELOAD")) if p))
    env[REEXEC_ENV] = "1"
    os.execve(sys.executable, [sys.executable, "-m", "posttrain", *argv], env)


def allocator_report() -> str:
    """One line for `posttrain env`: the allocator of this process and the one training commands use."""
    loaded = loaded_allocator()
    chosen = find_allocator()
    if os.environ.get(ALLOCATOR_ENV, "").strip().lower() in ("system", "glibc", "none", "0", "off"):
        training = f"glibc malloc ({ALLOCATOR_ENV}={os.environ[ALLOCATOR_ENV]})"
    elif chosen is None:
        training = "glibc malloc (install libtcmalloc-minimal4 or libjemalloc2 for a faster one)"
    else:
        training = f"{os.path.basename(chosen)} ({chosen})"
    here = os.path.basename(loaded) if loaded else "glibc malloc"
    return f"training: {training}; this process: {here}"


def threads_report() -> str:
    """One line for `posttrain env`: the compute threads a single-process training command would use."""
    busy = busy_now()
    settings = thread_settings(busy=busy)
    threads = settings.get("OMP_NUM_THREADS") or f"{os.environ['OMP_NUM_THREADS']} (OMP_NUM_THREADS)"
    wait = settings.get("OMP_WAIT_POLICY") or f"{os.environ['OMP_WAIT_POLICY']} (OMP_WAIT_POLICY)"
    others = f" ({busy} busy with other work now)" if busy else ""
    return f"{threads} of {physical_cores()} physical cores{others}, OpenMP waiting {wait.lower()}"
