"""Run untrusted Python snippets (model completions) behind a real isolation boundary.

In RL on code the policy writes the code that runs, and it will use whatever the reward lets it do. Two sandboxes:

`sandbox="bubblewrap"` (the default) starts every snippet in a fresh bubblewrap container: its own PID, network,
IPC, UTS and mount namespaces; a root file system that holds only read-only binds of the system libraries (/usr)
and the Python installation (base prefix and virtual environment); one size-capped tmpfs at /tmp that is the
working, temporary and home directory; a /proc that shows only the sandbox's own processes; no capabilities;
`--die-with-parent`. The trainer, its files, checkpoints, environment and the network are simply not there. A
trainer running as root drops the snippet to `nobody` (65534) so that the process limit applies (the kernel does
not enforce RLIMIT_NPROC for root). Each snippet gets a new container: nothing one leaves behind reaches the next.

`sandbox="process"` is the weaker fallback for machines without bubblewrap, used only when asked for (with a
warning): a fresh `python -I` in its own session and temporary directory, a minimal environment, the same resource
limits, and a Python-level network guard. It does NOT stop a snippet from signalling, reading or writing what the
trainer's user can (other processes' /proc, files, checkpoints), from reaching the network through ctypes or a
subprocess, or from filling the disk with many files under the size limit; as root it cannot cap processes.

Both apply rlimits in the child interpreter itself, first thing (address space, CPU time, file size, process
count, no core files) rather than in a `preexec_fn`, which can deadlock when the parent has threads (`run_many`
starts processes from a thread pool). A snippet's memory is at most `max_processes * memory_mb` plus `disk_mb`.
"""

from __future__ import annotations

import functools
import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import IO

from posttrain.errors import ConfigError

SANDBOXES = ("bubblewrap", "process")
SANDBOX_WORKDIR = "/tmp/work"  # inside bubblewrap: the snippet's working and home directory, on its tmpfs
NOBODY = 65534  # the uid/gid a root trainer's snippets run as

PROCESS_SANDBOX_WARNING = (
    "posttrain is running generated code in the weaker 'process' sandbox (sandbox='process'): it limits memory, CPU "
    "time, file sizes and processes (except as root) and blocks ordinary socket use, but it does NOT stop the code "
    "from signalling or killing the trainer, reading other processes' /proc (environment variables, tokens), "
    "writing anywhere the trainer's user can (checkpoints, data, home), reaching the network through ctypes or a "
    "subprocess, or filling the disk with many small files. Install bubblewrap (apt-get install bubblewrap) and "
    "use the default sandbox='bubblewrap' for completions you do not trust."
)

# Runs in the child via `python -I -c`, with argv = [memory bytes, CPU s, file bytes, processes, drop to nobody,
# guard the network]. stdin holds `<length>\n<source><input>`: the prelude reads exactly the source, so whatever
# follows stays on stdin for the snippet. It applies the limits, drops root, installs the network guard (process
# sandbox only: bubblewrap has no network to guard) and runs the snippet as `__main__`.
_PRELUDE = r"""
import sys


def _enter_sandbox():
    import os
    import resource

    memory_bytes, cpu_s, file_bytes, processes, drop_root, guard = (int(value) for value in sys.argv[1:7])
    sys.path.extend(sys.argv[7:])  # site-packages, added directly: `-S` skips the slow .pth processing
    limits = {
        resource.RLIMIT_AS: memory_bytes,
        resource.RLIMIT_CPU: cpu_s,
        resource.RLIMIT_FSIZE: file_bytes,
        resource.RLIMIT_NPROC: processes,
        resource.RLIMIT_CORE: 0,
    }
    for limit, value in limits.items():
        _, hard = resource.getrlimit(limit)
        if hard != resource.RLIM_INFINITY:
            value = min(value, hard)
        resource.setrlimit(limit, (value, value))
    if drop_root:
        os.setgroups([])
        os.setresgid(65534, 65534, 65534)
        os.setresuid(65534, 65534, 65534)  # clears every capability, including the two bubblewrap kept for this
        if os.getuid() == 0 or os.geteuid() == 0:
            os._exit(125)
    if guard:
        _guard_network()

    header = b""  # read unbuffered, so that what follows the source stays in the pipe for the snippet
    while not header.endswith(b"\n"):
        header += os.read(0, 1) or b"\n"
    length, chunks = int(header), []
    while length > 0:
        chunk = os.read(0, min(length, 1 << 20))
        if not chunk:
            break
        chunks.append(chunk)
        length -= len(chunk)
    source = b"".join(chunks).decode()
    sys.argv = ["<sandbox>"]
    return compile(source, "<sandbox>", "exec")


def _guard_network():
    import _socket
    import socket

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


_code = _enter_sandbox()
del _enter_sandbox, _guard_network
exec(_code)
"""


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


def check_sandbox(sandbox: str) -> None:
    """Raise ConfigError unless `sandbox` names a sandbox that can run here; warn once when it is the weak one.

    Call it before training so that a missing bubblewrap stops the run at once, not at the first reward.
    """
    if sandbox not in SANDBOXES:
        raise ConfigError(f"sandbox={sandbox!r} is not a sandbox; choose 'bubblewrap' (the default) or 'process'.")
    if sandbox == "process":
        _warn_process_sandbox()
        return
    command, problem = _bubblewrap()
    if command is None:
        raise ConfigError(
            f"sandbox='bubblewrap' cannot run here: {problem}. Generated code needs a sandbox it cannot escape; "
            "install bubblewrap (`apt-get install bubblewrap`; scripts/setup.sh does it when run as root), or opt "
            "into the weaker sandbox with sandbox='process' (it does not stop the code from killing the trainer, "
            "reading its secrets or writing its files)."
        )


def sandbox_backend() -> str:
    """The sandbox that `sandbox="bubblewrap"` gets on this machine, in words (for `posttrain env`)."""
    command, detail = _bubblewrap()
    if command is None:
        return f"process only ({detail}); code rewards need sandbox='process'"
    return detail


def run_python(
    code: str,
    *,
    timeout_s: float = 5.0,
    memory_mb: int = 512,
    file_size_mb: int = 16,
    disk_mb: int = 64,
    max_processes: int = 16,
    sandbox: str = "bubblewrap",
    stdin: str = "",
) -> SandboxResult:
    """Run `code` in a fresh, isolated, limited Python process and return its exit status and output.

    timeout_s: wall-clock limit; the whole sandbox is killed when it passes (CPU time is capped slightly above).
    memory_mb: address-space limit per process (allocations beyond it raise MemoryError in the snippet).
    file_size_mb: largest file the snippet may write; stdout and stderr are capped by it as well.
    disk_mb: size of the sandbox's tmpfs (working directory, /tmp, home); bubblewrap only.
    max_processes: processes and threads the snippet may run at once (RLIMIT_NPROC), counting itself.
    sandbox: "bubblewrap" (isolated; the default) or "process" (the weaker fallback; see the module docstring).
    stdin: text the snippet reads from its standard input.
    """
    for name, value in [
        ("timeout_s", timeout_s),
        ("memory_mb", memory_mb),
        ("file_size_mb", file_size_mb),
        ("disk_mb", disk_mb),
        ("max_processes", max_processes),
    ]:
        if not value > 0:
            raise ConfigError(f"sandbox limits must be positive, got {name}={value}; pass a positive value.")
    check_sandbox(sandbox)
    isolated = sandbox == "bubblewrap"
    root = os.geteuid() == 0
    # RLIMIT_NPROC counts every process of the (real) user: in bubblewrap's own user namespace that is just the
    # sandbox; a root trainer's snippets become `nobody`, a process-sandbox snippet stays the trainer's user.
    if isolated and not root:
        processes = max_processes
    else:
        processes = _tasks_of(NOBODY if isolated else os.getuid()) + max_processes
    limits = [
        str(int(memory_mb * 2**20)),
        str(math.ceil(timeout_s) + 1),
        str(int(file_size_mb * 2**20)),
        str(processes),
        str(int(isolated and root)),
        str(int(not isolated)),
    ]
    source = code.encode()
    data = b"%d\n" % len(source) + source + stdin.encode()
    workdir = None if isolated else tempfile.mkdtemp(prefix="posttrain-sandbox-")
    try:
        if isolated:
            command, _ = _bubblewrap()
            argv = [*_with_tmp_and_python(command, disk_mb), "--chdir", SANDBOX_WORKDIR, "--", *_interpreter(limits)]
            env, cwd = None, None
        else:
            argv, env, cwd = _interpreter(limits), _minimal_env(workdir), workdir
        return _run(argv, data, timeout_s, env, cwd)
    finally:
        if workdir is not None:
            shutil.rmtree(workdir, ignore_errors=True)


def run_many(
    codes: Sequence[str], *, max_workers: int = 2, stdins: Sequence[str] | None = None, **limits
) -> list[SandboxResult]:
    """Run several snippets concurrently (each with `run_python(code, stdin=..., **limits)`); results keep input
    order. `stdins`, when given, holds one standard input per snippet."""
    if max_workers < 1:
        raise ConfigError(f"max_workers must be at least 1, got {max_workers}.")
    if stdins is not None and len(stdins) != len(codes):
        raise ConfigError(f"run_many got {len(codes)} snippets but {len(stdins)} stdins; pass one per snippet.")
    check_sandbox(limits.get("sandbox", "bubblewrap"))
    inputs = [""] * len(codes) if stdins is None else stdins
    with ThreadPoolExecutor(max_workers=max_workers) as pool:
        return list(pool.map(lambda job: run_python(job[0], stdin=job[1], **limits), zip(codes, inputs)))


def _run(argv: list[str], data: bytes, timeout_s: float, env: dict[str, str] | None, cwd: str | None) -> SandboxResult:
    with tempfile.TemporaryFile() as stdout, tempfile.TemporaryFile() as stderr:
        start = time.monotonic()
        process = subprocess.Popen(
            argv, stdin=subprocess.PIPE, stdout=stdout, stderr=stderr, cwd=cwd, env=env, start_new_session=True
        )
        timed_out = False
        try:
            process.communicate(data, timeout=timeout_s)
        except subprocess.TimeoutExpired:
            timed_out = True
        except BrokenPipeError:  # the snippet exited before reading all of its stdin
            process.wait(timeout=timeout_s)
        finally:
            # Bubblewrap's outer process is the group leader: killing it kills the sandbox's init
            # (--die-with-parent), and with it every process in the sandbox's PID namespace.
            _kill_group(process.pid)
            process.wait()
        wall_s = time.monotonic() - start
        return SandboxResult(process.returncode, _read(stdout), _read(stderr), timed_out, wall_s)


def _interpreter(limits: list[str]) -> list[str]:
    return [sys.executable, "-I", "-S", "-c", _PRELUDE, *limits, *_site_packages()]


@functools.lru_cache(maxsize=1)
def _site_packages() -> tuple[str, ...]:
    """The environment's site-packages. The snippet starts with `-S` (no `site`: its .pth files, editable-install
    hooks included, cost about 0.15 s per interpreter) and gets these on sys.path instead."""
    import site

    return tuple(path for path in site.getsitepackages() if os.path.isdir(path))


_SANDBOX_ENV = {
    "PATH": "/usr/local/bin:/usr/bin:/bin",
    "LANG": "C.UTF-8",
    # One thread per numeric library keeps small snippets inside the address-space and process limits.
    "OMP_NUM_THREADS": "1",
    "OPENBLAS_NUM_THREADS": "1",
    "MKL_NUM_THREADS": "1",
}


def _minimal_env(workdir: str) -> dict[str, str]:
    """Only what a Python snippet needs; nothing from the parent (tokens, proxies, CUDA settings) leaks in."""
    return {**_SANDBOX_ENV, "HOME": workdir, "TMPDIR": workdir}


@functools.lru_cache(maxsize=1)
def _bubblewrap() -> tuple[tuple[str, ...] | None, str]:
    """(the bubblewrap command line up to the tmpfs and the interpreter's binds, its version) or (None, why it
    cannot run); probed once."""
    path = shutil.which("bwrap")
    if path is None:
        return None, "bubblewrap not found"
    try:
        version = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError) as error:
        return None, f"bubblewrap does not start ({error})"
    command = tuple(_bubblewrap_command(path))
    probe = subprocess.run(
        [*_with_tmp_and_python(command, None), "--", sys.executable, "-I", "-c", "pass"],
        capture_output=True,
        text=True,
        timeout=30,
    )
    if probe.returncode != 0:
        return None, f"{version or 'bubblewrap'} cannot create a sandbox here ({probe.stderr.strip()[-300:]})"
    return command, version or "bubblewrap"


def _bubblewrap_command(bwrap: str) -> list[str]:
    root = os.geteuid() == 0
    if root:
        # A root trainer runs bubblewrap privileged, without a user namespace, keeping only CAP_SETUID/SETGID so
        # that the prelude can become `nobody` (a user namespace would map the snippet back to root).
        unshare = [
            "--unshare-pid",
            "--unshare-net",
            "--unshare-ipc",
            "--unshare-uts",
            "--unshare-cgroup-try",
            "--cap-drop",
            "ALL",
            "--cap-add",
            "CAP_SETUID",
            "--cap-add",
            "CAP_SETGID",
        ]
    else:
        unshare = ["--unshare-all", "--cap-drop", "ALL"]
    argv = [bwrap, *unshare, "--die-with-parent", "--new-session", "--hostname", "sandbox", "--clearenv"]
    for name, value in {**_SANDBOX_ENV, "HOME": SANDBOX_WORKDIR, "TMPDIR": "/tmp"}.items():
        argv += ["--setenv", name, value]
    argv += ["--proc", "/proc", "--dev", "/dev"]
    # Merged-/usr systems link /bin, /lib, ... into /usr: recreate the links; otherwise bind the directories.
    for top in ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32"):
        if os.path.islink(top):
            argv += ["--symlink", os.readlink(top), top]
        elif os.path.isdir(top):
            argv += ["--ro-bind", top, top]
    for name in ("/etc/ld.so.cache", "/etc/localtime", "/etc/alternatives"):
        argv += ["--ro-bind-try", name, name]
    return argv


def _with_tmp_and_python(command, disk_mb: int | None) -> list[str]:
    """The sandbox's own /tmp (a tmpfs, `disk_mb` large), then the interpreter's directories bound read-only on top,
    so that an interpreter or virtual environment under /tmp stays visible."""
    size = [] if disk_mb is None else ["--size", str(int(disk_mb * 2**20))]
    argv = [*command, *size, "--perms", "1777", "--tmpfs", "/tmp"]
    for prefix in _python_dirs():
        # Parents made world-traversable: bubblewrap would copy a private home's 0700 (e.g. /root/.pyenv). The
        # tmpfs /tmp keeps its 1777.
        parents = [parent for parent in _parents(prefix) if not os.path.islink(parent) and parent != "/tmp"]
        argv += [arg for parent in parents for arg in ("--perms", "0755", "--dir", parent)]
        argv += ["--ro-bind", prefix, prefix]
    # The work directory is its own folder of the tmpfs: an interpreter bound under /tmp shows in /tmp's listing.
    return argv + ["--perms", "1777", "--dir", SANDBOX_WORKDIR]


def _python_dirs() -> list[str]:
    """The interpreter's installation and environment, as few top directories as cover them, outside /usr."""
    dirs = {sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix}
    dirs |= {os.path.dirname(os.path.dirname(os.path.realpath(sys.executable)))}
    dirs |= {os.path.realpath(path) for path in dirs}
    dirs = {path for path in dirs if os.path.isdir(path) and not path.startswith("/usr/") and path != "/usr"}
    return sorted(path for path in dirs if not any(path.startswith(other + "/") for other in dirs))


def _parents(path: str) -> list[str]:
    parts = path.strip("/").split("/")[:-1]
    return ["/" + "/".join(parts[: index + 1]) for index in range(len(parts))]


def _tasks_of(uid: int) -> int:
    """Processes and threads owned by `uid` now (what RLIMIT_NPROC counts)."""
    count = 0
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                if os.stat(f"/proc/{pid}").st_uid == uid:
                    count += len(os.listdir(f"/proc/{pid}/task"))
            except OSError:
                pass
    return count


@functools.lru_cache(maxsize=1)
def _warn_process_sandbox() -> None:
    warnings.warn(PROCESS_SANDBOX_WARNING, UserWarning, stacklevel=3)


def _kill_group(pid: int) -> None:
    """Kill the snippet's whole session group; processes it left behind die with it."""
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _read(file: IO[bytes]) -> str:
    file.seek(0)
    return file.read().decode("utf-8", errors="replace")
