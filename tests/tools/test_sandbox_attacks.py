"""One test per attack from issue 14, on bubblewrap (must fail) and on the process fallback (the documented
differences). Each also checks that a correct solution, scored in the same batch, still gets 1.0. Every attack is
bounded (few processes, small memory and disk, short timeouts): the machine is shared."""

import os
import signal
import socket
import subprocess
import sys
import time
import uuid

import pytest

from posttrain.rewards import get_code_execution_reward, run_python

TESTS = ["assert f(1) == 2", "assert f(2) == 3"]
CORRECT = "def f(x):\n    return x + 1\n"
ROOT = os.geteuid() == 0


@pytest.fixture
def victim():
    """A process of the trainer's user, standing in for the trainer, with a secret in its environment."""
    secret = uuid.uuid4().hex
    process = subprocess.Popen(["sleep", "60"], env={"HF_TOKEN": secret})
    yield process, secret
    process.kill()
    process.wait()


def _score_attack(attack: str, sandbox: str, **limits) -> list[float]:
    """Scores of [attack followed by a correct solution, a correct solution], run side by side."""
    reward = get_code_execution_reward(sandbox=sandbox, max_workers=2, **limits)
    return reward(completions=[attack + "\n" + CORRECT, CORRECT], tests=[TESTS, TESTS])


def test_kill_the_trainer(sandbox, victim):
    process, _ = victim
    targets = f"[{process.pid}]" if sandbox == "process" else f"[{process.pid}, os.getppid(), 1]"
    attack = (
        (
            "import os, signal\n"
            f"for pid in {targets} + [int(p) for p in os.listdir('/proc') if p.isdigit() and int(p) != os.getpid()]:\n"
            "    try:\n"
            "        os.kill(pid, signal.SIGKILL)\n"
            "    except OSError:\n"
            "        pass\n"
        )
        if sandbox == "bubblewrap"
        else f"import os, signal\nos.kill({process.pid}, signal.SIGKILL)\n"
    )
    scores = _score_attack(attack, sandbox)
    assert scores[1] == 1.0
    time.sleep(0.2)
    if sandbox == "bubblewrap":
        assert process.poll() is None  # the trainer's processes are not even visible
        assert scores[0] == 1.0  # and the attack's own sandbox survived its attempts
    else:
        assert process.poll() == -signal.SIGKILL  # documented: the process sandbox does not stop signals


def test_read_the_trainers_environment(sandbox, victim):
    process, secret = victim
    attack = (
        "import os\n"
        f"pids = [{process.pid}, os.getppid()] + [p for p in os.listdir('/proc') if p.isdigit()]\n"
        "for pid in pids:\n"
        "    try:\n"
        "        print(open(f'/proc/{pid}/environ', 'rb').read())\n"
        "    except OSError as error:\n"
        "        print(pid, type(error).__name__)\n"
        "print(dict(os.environ))\n"
    )
    result = run_python(attack, sandbox=sandbox)
    assert result.ok, result.stderr
    if sandbox == "bubblewrap":
        assert secret not in result.stdout
        assert f"{process.pid} FileNotFoundError" in result.stdout  # no such process in the sandbox
    else:
        assert secret in result.stdout  # documented: other processes' /proc is readable in the process sandbox
    assert _score_attack(attack, sandbox)[1] == 1.0


def _write_attack(paths: list[str]) -> str:
    return "".join(
        f"try:\n    open({path!r}, 'w').write('pwned')\nexcept OSError as error:\n    print(type(error).__name__)\n"
        for path in paths
    )


def test_write_outside_the_work_directory(sandbox, tmp_path):
    outside = tmp_path / "checkpoint.bin"
    paths = [str(outside)]
    if sandbox == "bubblewrap":  # paths the sandbox sees, read-only: the Python installation and environment
        paths += [os.path.join(sys.prefix, f"pwned-{uuid.uuid4().hex}"), os.path.join(sys.base_prefix, "pwned")]
    try:
        result = run_python(_write_attack(paths), sandbox=sandbox)
        if sandbox == "bubblewrap":
            assert not any(os.path.exists(path) for path in paths)
            assert result.stdout.split() == ["FileNotFoundError", "OSError", "OSError"], result.stdout
        else:
            assert outside.read_text() == "pwned"  # documented: the process sandbox writes where the user can
        assert _score_attack(_write_attack(paths), sandbox)[1] == 1.0
    finally:
        for path in paths[1:]:
            if os.path.exists(path):
                os.remove(path)


def test_spawned_process_writes_outside(sandbox, tmp_path):
    outside = tmp_path / "late.txt"
    # A detached grandchild (own session, so a process-group kill misses it) writes after the snippet ended.
    attack = (
        "import os, subprocess\n"
        f"subprocess.Popen(['sh', '-c', 'sleep 0.5; echo pwned > {outside}'], start_new_session=True)\n"
    )
    run_python(attack, sandbox=sandbox)
    time.sleep(1.5)
    if sandbox == "bubblewrap":
        assert not outside.exists()  # killed with the sandbox's PID namespace, and the path is not there anyway
    else:
        assert outside.read_text() == "pwned\n"  # documented: a detached process outlives the process sandbox
    assert _score_attack(attack, sandbox)[1] == 1.0


def test_network_connection_to_a_loopback_server(sandbox):
    with socket.create_server(("127.0.0.1", 0)) as server:
        server.settimeout(0.5)
        port = server.getsockname()[1]
        direct = (
            "import socket\n"
            f"try:\n    socket.create_connection(('127.0.0.1', {port}), timeout=1)\n"
            "    print('connected', flush=True)\n"
            "except OSError as error:\n    print(type(error).__name__, flush=True)\n"
        )
        # Around the Python guard: a fresh interpreter in a subprocess.
        bypass = f"import subprocess, sys\nsubprocess.run([sys.executable, '-I', '-c', {direct!r}])\n"
        result = run_python(direct + bypass, sandbox=sandbox)
        accepted = []
        try:
            while True:
                accepted.append(server.accept()[0])
        except TimeoutError:
            pass
        for connection in accepted:
            connection.close()
        if sandbox == "bubblewrap":
            assert result.stdout.split() == ["ConnectionRefusedError"] * 2, result.stderr  # its own empty loopback
            assert accepted == []
        else:
            assert result.stdout.split() == ["PermissionError", "connected"]  # documented: the guard is Python-only
            assert len(accepted) == 1
        assert _score_attack(direct, sandbox)[1] == 1.0


def test_fork_bomb_is_capped(sandbox):
    if sandbox == "process" and ROOT:
        pytest.skip(
            "documented: the kernel does not apply RLIMIT_NPROC to root, so the process sandbox cannot cap "
            "a root trainer's snippets (bubblewrap runs them as nobody)"
        )
    # Bounded even if the cap failed: at most 60 forks, each child sleeps and exits.
    attack = (
        "import os, time\n"
        "children = 0\n"
        "try:\n"
        "    for _ in range(60):\n"
        "        if os.fork() == 0:\n"
        "            time.sleep(3)\n"
        "            os._exit(0)\n"
        "        children += 1\n"
        "except OSError as error:\n"
        "    print('stopped after', children, type(error).__name__)\n"
    )
    result = run_python(attack, sandbox=sandbox, max_processes=8, timeout_s=5.0, memory_mb=256)
    words = result.stdout.split()
    assert words[:2] == ["stopped", "after"] and words[3] == "BlockingIOError", result.stdout + result.stderr
    assert int(words[2]) < 8
    assert _score_attack(attack, sandbox, timeout_s=5.0)[1] == 1.0


def test_memory_exhaustion_fails_inside_the_sandbox(sandbox):
    attack = "block = bytearray(2 * 1024**3)\nprint('allocated')\n"
    result = run_python(attack, sandbox=sandbox, memory_mb=256)
    assert result.returncode == 1 and not result.timed_out
    assert "MemoryError" in result.stderr and "allocated" not in result.stdout
    assert run_python("print(len(bytearray(10 * 1024**2)))", sandbox=sandbox, memory_mb=256).stdout == "10485760\n"
    assert _score_attack(attack, sandbox, memory_mb=256) == [0.0, 1.0]


def test_filling_the_disk(sandbox):
    # 1 MiB files, at most 24 of them: the bubblewrap tmpfs holds 8 MiB; the process sandbox caps only each file.
    attack = (
        "written = 0\n"
        "try:\n"
        "    for index in range(24):\n"
        "        open(f'fill-{index}', 'wb').write(b'x' * 1024**2)\n"
        "        written += 1\n"
        "except OSError as error:\n"
        "    print(error.strerror)\n"
        "print('written', written)\n"
    )
    result = run_python(attack, sandbox=sandbox, disk_mb=8, file_size_mb=2)
    if sandbox == "bubblewrap":
        assert result.stdout.splitlines()[0] == "No space left on device", result.stdout + result.stderr
        assert int(result.stdout.split()[-1]) <= 8
    else:
        assert result.stdout.split()[-1] == "24"  # documented: no total cap; the directory is removed afterwards
    assert _score_attack(attack, sandbox)[1] == 1.0


def test_sleep_past_the_timeout(sandbox):
    attack = "import time\ntime.sleep(30)\n"
    start = time.monotonic()
    result = run_python(attack, sandbox=sandbox, timeout_s=1.0)
    assert result.timed_out and time.monotonic() - start < 3.0
    start = time.monotonic()
    assert _score_attack(attack, sandbox, timeout_s=1.0) == [0.0, 1.0]
    assert time.monotonic() - start < 3.0
