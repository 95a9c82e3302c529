"""The code sandbox: limits, isolation, network guard, process-group cleanup, and the code execution reward."""

import os
import socket
import time

import pytest

from posttrain.errors import ConfigError
from posttrain.rewards import get_code_execution_reward, run_many, run_python


def _is_gone(pid: int, wait_s: float = 2.0) -> bool:
    """True once `pid` no longer runs (missing, or a zombie nobody has reaped yet)."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            with open(f"/proc/{pid}/stat") as stat:
                state = stat.read().rsplit(")", 1)[1].split()[0]
        except FileNotFoundError:
            return True
        if state in ("Z", "X"):
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)


def test_output_exit_status_and_traceback_are_reported():
    result = run_python('print("hello")\nprint("oops", file=__import__("sys").stderr)\nraise SystemExit(3)')
    assert (result.returncode, result.stdout, result.stderr, result.timed_out) == (3, "hello\n", "oops\n", False)
    assert not result.ok

    failed = run_python('x = 1\nraise ValueError("boom")')
    assert failed.returncode == 1
    assert 'File "<sandbox>", line 2' in failed.stderr
    assert failed.stderr.rstrip().endswith("ValueError: boom")
    assert run_python("pass").ok


def test_fresh_temporary_directory_is_removed_and_environment_is_minimal(monkeypatch):
    monkeypatch.setenv("POSTTRAIN_TEST_SECRET", "do-not-leak")
    result = run_python(
        "import os\n"
        "open('scratch.txt', 'w').write('data')\n"
        "print(os.getcwd())\n"
        "print(sorted(os.listdir('.')))\n"
        "print('POSTTRAIN_TEST_SECRET' in os.environ)\n"
    )
    workdir, listing, leaked = result.stdout.splitlines()
    assert os.path.basename(workdir).startswith("posttrain-sandbox-")
    assert listing == "['scratch.txt']"  # it started empty
    assert leaked == "False"
    assert not os.path.exists(workdir)


def test_infinite_loop_is_killed_within_the_timeout():
    start = time.monotonic()
    result = run_python("while True:\n    pass", timeout_s=1.0)
    assert time.monotonic() - start < 1.0 + 2.0
    assert result.timed_out and not result.ok
    assert result.returncode == -9


def test_memory_hog_fails_inside_the_sandbox():
    result = run_python("block = bytearray(2 * 1024**3)\nprint('allocated')")  # default limit: 512 MB
    assert result.returncode == 1 and not result.timed_out
    assert "MemoryError" in result.stderr
    assert "allocated" not in result.stdout
    assert run_python("print(len(bytearray(10 * 1024**2)))").stdout == f"{10 * 1024**2}\n"  # small ones still work


def test_file_size_limit():
    result = run_python("open('big.bin', 'wb').write(b'x' * 2 * 1024**2)", file_size_mb=1)
    assert result.returncode == 1
    assert "File too large" in result.stderr


def test_network_is_refused_but_local_socketpairs_work():
    with socket.create_server(("127.0.0.1", 0)) as server:
        port = server.getsockname()[1]
        socket.create_connection(("127.0.0.1", port), timeout=1).close()  # reachable from outside the sandbox
        attempts = {
            "connect": f"socket.create_connection(('127.0.0.1', {port}), timeout=1)",
            "raw socket": f"socket.socket(socket.AF_INET, socket.SOCK_STREAM).connect(('127.0.0.1', {port}))",
            "C-level socket": "__import__('_socket').socket(socket.AF_INET6)",
            "dns": "socket.getaddrinfo('localhost', 80)",
            "dns by name": "socket.gethostbyname('localhost')",
        }
        code = "import socket\n" + "".join(
            f"try:\n    {call}\n    print({name!r}, 'connected')\n"
            f"except PermissionError:\n    print({name!r}, 'refused')\n"
            for name, call in attempts.items()
        )
        result = run_python(code + "import asyncio\nprint(asyncio.run(asyncio.sleep(0, 'asyncio works')))")
    assert result.stdout.splitlines() == [f"{name} refused" for name in attempts] + ["asyncio works"], result.stderr


@pytest.mark.parametrize(
    "ending, timeout_s",
    [("", 10.0), ("while True:\n    pass\n", 1.0)],
    ids=["parent-exits", "parent-times-out"],
)
def test_grandchild_processes_are_killed_with_the_group(ending, timeout_s):
    code = (
        "import os, subprocess\n"
        "child = subprocess.Popen(['sleep', '30'])\n"
        "print(child.pid, flush=True)\n"
    ) + ending
    result = run_python(code, timeout_s=timeout_s)
    grandchild = int(result.stdout.split()[0])
    assert _is_gone(grandchild)


def test_run_many_keeps_order_and_runs_in_parallel():
    start = time.monotonic()
    results = run_many([f"import time; time.sleep(0.5); print({index})" for index in range(4)], max_workers=2)
    elapsed = time.monotonic() - start
    assert [result.stdout for result in results] == ["0\n", "1\n", "2\n", "3\n"]
    assert 1.0 <= elapsed < 1.9  # two waves of two; one at a time would take at least 2 s


def test_bad_limits_are_config_errors():
    with pytest.raises(ConfigError, match="timeout_s=0"):
        run_python("pass", timeout_s=0)
    with pytest.raises(ConfigError, match="max_workers"):
        run_many(["pass"], max_workers=0)


def test_code_execution_reward_pass_rates():
    reward = get_code_execution_reward(timeout_s=2.0)
    add_one = "Here it is:\n```python\ndef f(x):\n    return x + 1\n```\n"
    always_two = [{"role": "assistant", "content": "```python\ndef f(x):\n    return 2\n```"}]
    tests = ["assert f(1) == 2", "assert f(2) == 3"]
    scores = reward(
        prompts=["p"] * 5,
        completions=[add_one, always_two, "def f(x):\n    raise RuntimeError", "this is not code", add_one],
        test_cases=[tests, tests, tests, tests, None],
        trainer_state=None,
    )
    assert scores == [1.0, 0.5, 0.0, 0.0, None]


def test_code_execution_reward_counts_tests_passed_before_a_timeout():
    reward = get_code_execution_reward(timeout_s=1.0)
    solution = "def f(x):\n    while x > 1:\n        pass\n    return x\n"
    start = time.monotonic()
    scores = reward(completions=[solution], tests=["assert f(1) == 1\nassert f(2) == 2\nassert f(1) == 1"])
    assert time.monotonic() - start < 1.0 + 2.0
    assert scores == [pytest.approx(1 / 3)]  # the second test hangs; the third never runs


def test_code_execution_reward_skips_main_block_and_ignores_printed_lines():
    solution = (
        "def f(x):\n    return x\n"
        "print('0 0')\nprint('passed 0')\n"
        "if __name__ == '__main__':\n    input()\n"
    )
    assert get_code_execution_reward()(completions=[solution], tests=[["assert f(1) == 1", "assert f(1) == 2"]]) == [
        0.5
    ]
