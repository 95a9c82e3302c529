"""Run untrusted Python snippets (model completions) in a separate, limited process.

Each run gets a fresh interpreter (`python -I`: no user site, no PYTHON* variables, no current directory on
`sys.path`), a fresh temporary working directory that is deleted afterwards, a minimal environment, resource
limits (address space, CPU time, file size, no core files) and its own session, so that on timeout or exit the
whole process group, grandchildren included, is killed.

Network access is refused by a small guard installed before the snippet runs: it replaces the socket
constructor (only AF_UNIX sockets, which asyncio needs, remain) and the DNS functions with ones that raise
PermissionError. This stops ordinary and accidental use; it is NOT a security boundary (a determined snippet
can reach the network through ctypes or a subprocess, or raise its limits when running as root). Use a
container or VM for adversarial code.

The limits are set by the child interpreter itself, first thing, rather than in a `preexec_fn`: `preexec_fn`
can deadlock when the parent has threads, and `run_many` starts processes from a thread pool.
"""

from __future__ import annotations

import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import IO

from posttrain.errors import ConfigError

# Runs in the child via `python -I -c`, with argv = [memory bytes, CPU seconds, file bytes]. It applies the
# limits, installs the network guard, reads the snippet from stdin and runs it as `__main__`.
_PRELUDE = r'''
import sys


def _enter_sandbox():
    import _socket
    import resource
    import socket

    memory_bytes, cpu_s, file_bytes = (int(value) for value in sys.argv[1:4])
    limits = {
        resource.RLIMIT_AS: memory_bytes,
        resource.RLIMIT_CPU: cpu_s,
        resource.RLIMIT_FSIZE: file_bytes,
        resource.RLIMIT_CORE: 0,
    }
    for limit, value in limits.items():
        _, hard = resource.getrlimit(limit)
        if hard != resource.RLIM_INFINITY:
            value = min(value, hard)
        resource.setrlimit(limit, (value, value))

    def refuse(*args, **kwargs):
        raise PermissionError("network access is disabled in the posttrain sandbox")

    # socket.socket.__init__ looks up `_socket.socket.__init__` on every call, so guarding the C-level class
    # covers socket.socket, sockets made directly from _socket, and a reloaded socket module alike.
    unguarded = _socket.socket

    class LocalOnlySocket(unguarded):
        __slots__ = ()  # like the C class, so `class socket(_socket.socket)` still works on a reload

        def __init__(self, family=-1, type=-1, proto=-1, fileno=None):
            if family != socket.AF_UNIX:
                refuse()
            unguarded.__init__(self, family, type, proto, fileno)

    _socket.socket = _socket.SocketType = socket.SocketType = LocalOnlySocket
    for module in (socket, _socket):
        for name in ("getaddrinfo", "gethostbyname", "gethostbyname_ex", "gethostbyaddr", "getnameinfo"):
            setattr(module, name, refuse)

    source = sys.stdin.read()
    sys.argv = ["<sandbox>"]
    return compile(source, "<sandbox>", "exec")


_code = _enter_sandbox()
del _enter_sandbox
exec(_code)
'''


@dataclass(frozen=True)
class SandboxResult:
    """Outcome of one sandboxed run; `returncode` is negative when a signal ended the process."""

    returncode: int
    stdout: str
    stderr: str
    timed_out: bool
    wall_s: float

    @property
    def ok(self) -> bool:
        """The snippet finished in time and exited with status 0."""
        return self.returncode == 0 and not self.timed_out


def run_python(
    code: str, *, timeout_s: float = 5.0, memory_mb: int = 512, file_size_mb: int = 16
) -> SandboxResult:
    """Run `code` in a fresh, limited Python process and return its exit status and output.

    timeout_s: wall-clock limit; the process group is killed when it passes (CPU time is capped slightly above).
    memory_mb: address-space limit (allocations beyond it raise MemoryError in the snippet).
    file_size_mb: largest file the snippet may write; stdout and stderr are capped by it as well.
    """
    if timeout_s <= 0 or memory_mb <= 0 or file_size_mb <= 0:
        raise ConfigError(
            f"sandbox limits must be positive, got timeout_s={timeout_s}, memory_mb={memory_mb}, "
            f"file_size_mb={file_size_mb}; pass positive values."
        )
    limits = [str(int(memory_mb * 2**20)), str(math.ceil(timeout_s) + 1), str(int(file_size_mb * 2**20))]
    workdir = tempfile.mkdtemp(prefix="posttrain-sandbox-")
    try:
        with tempfile.TemporaryFile() as stdout, tempfile.TemporaryFile() as stderr:
            start = time.monotonic()
            process = subprocess.Popen(
                [sys.executable, "-I", "-c", _PRELUDE, *limits],
                stdin=subprocess.PIPE,
                stdout=stdout,
                stderr=stderr,
                cwd=workdir,
                env=_minimal_env(workdir),
                start_new_session=True,
            )
            timed_out = False
            try:
                process.communicate(code.encode(), timeout=timeout_s)
            except subprocess.TimeoutExpired:
                timed_out = True
            finally:
                _kill_group(process.pid)
                process.wait()
            wall_s = time.monotonic() - start
            return SandboxResult(process.returncode, _read(stdout), _read(stderr), timed_out, wall_s)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def run_many(
    codes: Sequence[str], *, max_workers: int = 2, **limits: float
) -> list[SandboxResult]:
    """Run several snippets concurrently (each with `run_python(code, **limits)`); results keep input order."""
    if max_workers < 1:
        raise ConfigError(f"max_workers must be at least 1, got {max_workers}.")
    with ThreadPoolExecutor(max_workers=max_workers) as pool:
        return list(pool.map(lambda code: run_python(code, **limits), codes))


def _minimal_env(workdir: str) -> dict[str, str]:
    """Only what a Python snippet needs; nothing from the parent (tokens, proxies, CUDA settings) leaks in."""
    return {
        "PATH": "/usr/local/bin:/usr/bin:/bin",
        "HOME": workdir,
        "TMPDIR": workdir,
        "LANG": "C.UTF-8",
        # One thread per numeric library keeps small snippets inside the address-space limit.
        "OMP_NUM_THREADS": "1",
        "OPENBLAS_NUM_THREADS": "1",
        "MKL_NUM_THREADS": "1",
    }


def _kill_group(pid: int) -> None:
    """Kill the snippet's whole session group; processes it left behind die with it."""
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _read(file: IO[bytes]) -> str:
    file.seek(0)
    return file.read().decode("utf-8", errors="replace")
