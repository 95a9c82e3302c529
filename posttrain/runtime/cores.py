"""The CPU cores a run may use, and how asynchronous generation divides them between a generation process and
training. Torch-free, so that `posttrain env` can show the split without importing torch.

A core here is a physical core: hyper-thread siblings contend for the same units, so they go to the same side.
A core counts as busy when other work kept one of its CPUs at least `busy_share` busy over a short look at
/proc/stat; busy cores are left to that work.
"""

from __future__ import annotations

import glob
import os
import time
from dataclasses import dataclass

__all__ = [
    "CoreSplit",
    "busy_core_ids",
    "cores_of_cpus",
    "cpu_times",
    "free_cores",
    "generation_core_split",
    "pin_process",
]

BUSY_SHARE = 0.75  # a core this busy with other work while we look is left to it
BUSY_LOOK_S = 0.3  # how long we look


def cores_of_cpus() -> dict[int, str]:
    """{CPU this process may run on (its affinity mask): its physical core} (hyper-thread siblings share one)."""
    try:
        cpus = sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return {cpu: str(cpu) for cpu in range(os.cpu_count() or 1)}
    cores = {}
    for cpu in cpus:
        siblings = glob.glob(f"/sys/devices/system/cpu/cpu{cpu}/topology/thread_siblings_list")
        try:
            with open(siblings[0], encoding="utf-8") as f:
                cores[cpu] = f.read().strip()
        except (IndexError, OSError):
            cores[cpu] = str(cpu)
    return cores


def cpu_times(path: str = "/proc/stat") -> dict[int, tuple[int, int]]:
    """{CPU: (all jiffies, idle + iowait jiffies)} since boot; {} where /proc/stat cannot be read."""
    times = {}
    try:
        with open(path, encoding="utf-8") as f:
            for line in f:
                fields = line.split()
                if fields and fields[0].startswith("cpu") and fields[0][3:].isdigit():
                    values = [int(v) for v in fields[1:]]
                    times[int(fields[0][3:])] = (sum(values), values[3] + (values[4] if len(values) > 4 else 0))
    except (OSError, ValueError, IndexError):
        return {}
    return times


def busy_core_ids(
    before: dict[int, tuple[int, int]],
    after: dict[int, tuple[int, int]],
    cores: dict[int, str],
    busy_share: float = BUSY_SHARE,
) -> set[str]:
    """The physical cores (of `cores`, {CPU: core}) that were at least `busy_share` busy between two `cpu_times`
    snapshots; a core counts once any of its hyper-threads is busy."""
    busy = set()
    for cpu, core in cores.items():
        if cpu in before and cpu in after:
            total, idle = (a - b for a, b in zip(after[cpu], before[cpu]))
            if total > 0 and (total - idle) >= busy_share * total:
                busy.add(core)
    return busy


def free_cores(look_s: float = BUSY_LOOK_S) -> dict[str, list[int]]:
    """{physical core: its CPUs} of the cores this process may run on that other work does not keep busy
    (looked at for `look_s` seconds; 0: every core of the affinity mask counts as free)."""
    cores = cores_of_cpus()
    busy: set[str] = set()
    if look_s > 0:
        before = cpu_times()
        time.sleep(look_s)
        busy = busy_core_ids(before, cpu_times(), cores)
    free: dict[str, list[int]] = {}
    for cpu, core in cores.items():
        if core not in busy:
            free.setdefault(core, []).append(cpu)
    return free


@dataclass(frozen=True)
class CoreSplit:
    """CPUs for the generation process and for training, and the compute threads of each (one per physical
    core)."""

    generation: tuple[int, ...]
    training: tuple[int, ...]
    generation_threads: int
    training_threads: int

    def describe(self) -> str:
        return (
            f"generation {self.generation_threads} core(s) (CPUs {_spell(self.generation)}), "
            f"training {self.training_threads} core(s) (CPUs {_spell(self.training)})"
        )


def generation_core_split(
    cores: dict[str, list[int]] | None = None, generation_cores: int | None = None
) -> CoreSplit | None:
    """How asynchronous generation divides the free cores (`free_cores()` when not given): `generation_cores`
    of them (default: half, rounded down) to the generation process, the rest to training. None with fewer than
    two free cores or when either side would get none: generation then runs in a thread of the training process.
    Decoding a small batch scales worse with threads than the training forward and backward do, so the default
    does not give generation more than half."""
    cores = free_cores() if cores is None else cores
    names = sorted(cores, key=lambda core: min(cores[core]))
    count = len(names) // 2 if generation_cores is None else generation_cores
    if len(names) < 2 or not 0 < count < len(names):
        return None
    generation, training = names[:count], names[count:]
    return CoreSplit(
        tuple(sorted(cpu for core in generation for cpu in cores[core])),
        tuple(sorted(cpu for core in training for cpu in cores[core])),
        len(generation),
        len(training),
    )


def pin_process(cpus) -> set[int]:
    """Restricts every thread of this process (OpenMP's pool included) to `cpus`; threads started later inherit
    it. Returns the CPUs the calling thread could use before, to restore them."""
    before = os.sched_getaffinity(0)
    cpus = set(cpus)
    try:
        threads = [int(tid) for tid in os.listdir("/proc/self/task")]
    except OSError:
        threads = [0]
    for tid in threads:
        try:
            os.sched_setaffinity(tid, cpus)
        except OSError:  # a thread that ended meanwhile
            pass
    return before


def _spell(cpus: tuple[int, ...]) -> str:
    return ",".join(str(cpu) for cpu in cpus)
