"""The code sandbox: limits, isolation, network guard, process cleanup, the sandbox choice, and the code execution
reward with its reward-hacking guards. Tests that take a `sandbox` run on bubblewrap (skipped where it cannot run)
and on the process fallback."""

import os
import socket
import time
import warnings

import pytest

from posttrain.errors import ConfigError
from posttrain.rewards import get_code_execution_reward, run_many, run_python
from posttrain.rewards import sandbox as sandbox_module


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


def _processes_running(argument: str, wait_s: float = 2.0) -> list[int]:
    """Host pids (not zombies) whose command line contains `argument`, once the grace period is over."""
    deadline = time.monotonic() + wait_s
    while True:
        found = []
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as cmdline:
                    if argument.encode() in cmdline.read().split(b"\0") and not _is_gone(int(pid), 0):
                        found.append(int(pid))
            except OSError:
                pass
        if not found or time.monotonic() > deadline:
            return found
        time.sleep(0.1)


def test_output_exit_status_and_traceback_are_reported(sandbox):
    result = run_python(
        'print("hello")\nprint("oops", file=__import__("sys").stderr)\nraise SystemExit(3)', sandbox=sandbox
    )
    assert (result.returncode, result.stdout, result.stderr, result.timed_out) == (3, "hello\n", "oops\n", False)
    assert not result.ok

    failed = run_python('x = 1\nraise ValueError("boom")', sandbox=sandbox)
    assert failed.returncode == 1
    assert 'File "<sandbox>", line 2' in failed.stderr
    assert failed.stderr.rstrip().endswith("ValueError: boom")
    assert run_python("pass", sandbox=sandbox).ok
    assert run_python("import sys\nprint(sys.stdin.read()[::-1])", stdin="abc", sandbox=sandbox).stdout == "cba\n"


def test_fresh_working_directory_and_minimal_environment(sandbox, monkeypatch):
    monkeypatch.setenv("POSTTRAIN_TEST_SECRET", "do-not-leak")
    code = (
        "import os\n"
        "print(sorted(os.listdir('.')))\n"
        "open('scratch.txt', 'w').write('data')\n"
        "print(os.getcwd())\n"
        "print('POSTTRAIN_TEST_SECRET' in os.environ)\n"
    )
    first, second = (run_python(code, sandbox=sandbox) for _ in range(2))
    listing, workdir, leaked = first.stdout.splitlines()
    assert listing == "[]" and leaked == "False"
    assert second.stdout.splitlines()[0] == "[]"  # the second run does not see the first one's file
    if sandbox == "process":
        assert os.path.basename(workdir).startswith("posttrain-sandbox-")
        assert not os.path.exists(workdir)  # removed afterwards
    else:
        assert workdir == "/tmp/work"  # on the sandbox's own tmpfs


def test_infinite_loop_is_killed_within_the_timeout(sandbox):
    start = time.monotonic()
    result = run_python("while True:\n    pass", timeout_s=1.0, sandbox=sandbox)
    assert time.monotonic() - start < 1.0 + 2.0
    assert result.timed_out and not result.ok
    assert result.returncode == -9


def test_file_size_limit(sandbox):
    result = run_python("open('big.bin', 'wb').write(b'x' * 2 * 1024**2)", file_size_mb=1, sandbox=sandbox)
    assert result.returncode == -25 or "File too large" in result.stderr  # SIGXFSZ or EFBIG
    assert not result.ok


def test_python_network_guard_in_the_process_sandbox():
    """The process sandbox's guard refuses sockets (bubblewrap needs none: it has no network; see the attacks)."""
    with socket.create_server(("127.0.0.1", 0)) as server, warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*weaker 'process' sandbox")
        port = server.getsockname()[1]
        socket.create_connection(("127.0.0.1", port), timeout=1).close()  # reachable from outside the sandbox
        server.accept()[0].close()
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
        result = run_python(
            code + "import asyncio\nprint(asyncio.run(asyncio.sleep(0, 'asyncio works')))", sandbox="process"
        )
    assert result.stdout.splitlines() == [f"{name} refused" for name in attempts] + ["asyncio works"], result.stderr


@pytest.mark.parametrize(
    "ending, timeout_s",
    [("", 10.0), ("while True:\n    pass\n", 1.0)],
    ids=["parent-exits", "parent-times-out"],
)
def test_child_processes_are_killed_with_the_sandbox(sandbox, ending, timeout_s):
    tag = f"{time.time_ns() % 10**9}.5"  # a unique `sleep` argument, to find the child from the host
    code = f"import subprocess\nsubprocess.Popen(['sleep', '{tag}'])\n" + ending
    run_python(code, timeout_s=timeout_s, sandbox=sandbox)
    assert _processes_running(tag) == []


def test_run_many_keeps_order_and_runs_in_parallel(sandbox):
    start = time.monotonic()
    results = run_many(
        [f"import time; time.sleep(1.0); print({index})" for index in range(4)], max_workers=2, sandbox=sandbox
    )
    elapsed = time.monotonic() - start
    assert [result.stdout for result in results] == ["0\n", "1\n", "2\n", "3\n"]
    assert 2.0 <= elapsed < 3.9  # two waves of two; one at a time would take at least 4 s


def test_bad_limits_and_sandbox_names_are_config_errors():
    with pytest.raises(ConfigError, match="timeout_s=0"):
        run_python("pass", timeout_s=0)
    with pytest.raises(ConfigError, match="max_processes=0"):
        run_python("pass", max_processes=0)
    with pytest.raises(ConfigError, match="max_workers"):
        run_many(["pass"], max_workers=0)
    with pytest.raises(ConfigError, match="'docker' is not a sandbox"):
        run_python("pass", sandbox="docker")
    with pytest.raises(ConfigError, match="'docker' is not a sandbox"):
        get_code_execution_reward(sandbox="docker")


def test_missing_bubblewrap_refuses_unless_the_process_sandbox_is_chosen(monkeypatch):
    monkeypatch.setattr(sandbox_module.shutil, "which", lambda name: None)
    sandbox_module._bubblewrap.cache_clear()
    sandbox_module._warn_process_sandbox.cache_clear()
    try:
        assert sandbox_module.sandbox_backend().startswith("process only (bubblewrap not found)")
        reward = get_code_execution_reward()  # building it is fine; running code is not
        with pytest.raises(ConfigError, match="install bubblewrap.*sandbox='process'"):
            reward(completions=["def f():\n    return 1"], tests=[["assert f() == 1"]])
        with pytest.raises(ConfigError, match="sandbox='bubblewrap' cannot run here: bubblewrap not found"):
            run_python("pass")
        with pytest.warns(UserWarning, match="does NOT stop the code from signalling or killing the trainer"):
            scores = get_code_execution_reward(sandbox="process")(
                completions=["def f():\n    return 1"], tests=[["assert f() == 1"]]
            )
        assert scores == [1.0]
        # A trainer given the reward stops when it is built, before any training.
        from posttrain.rewards.scoring import RewardScorer

        with pytest.raises(ConfigError, match="sandbox='bubblewrap' cannot run here"):
            RewardScorer([get_code_execution_reward()])
        RewardScorer([get_code_execution_reward(sandbox="process")])
    finally:
        sandbox_module._bubblewrap.cache_clear()


def test_backend_is_reported():
    command, detail = sandbox_module._bubblewrap()
    backend = sandbox_module.sandbox_backend()
    assert backend.startswith("bubblewrap ") if command is not None else backend.startswith("process only")


def test_code_execution_reward_pass_rates(sandbox):
    reward = get_code_execution_reward(timeout_s=2.0, sandbox=sandbox)
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


def test_code_execution_reward_counts_tests_passed_before_a_timeout(sandbox):
    reward = get_code_execution_reward(timeout_s=1.0, sandbox=sandbox)
    solution = "def f(x):\n    while x > 1:\n        pass\n    return x\n"
    start = time.monotonic()
    scores = reward(completions=[solution], tests=["assert f(1) == 1\nassert f(2) == 2\nassert f(1) == 1"])
    assert time.monotonic() - start < 1.0 + 2.0
    assert scores == [pytest.approx(1 / 3)]  # the second test hangs; the third never runs


def test_code_execution_reward_skips_main_block_and_ignores_printed_lines(sandbox):
    solution = "def f(x):\n    return x\nprint('0 0')\nprint('passed 0')\nif __name__ == '__main__':\n    input()\n"
    reward = get_code_execution_reward(sandbox=sandbox)
    assert reward(completions=[solution], tests=[["assert f(1) == 1", "assert f(1) == 2"]]) == [0.5]


# Reward hacks: each completion defines a wrong `f` (every test fails) and then tries to be scored as passing.
_WRONG = "def f(x):\n    return 0\n"
_HACKS = {
    "os._exit(0)": "import os\nos._exit(0)\n",
    "sys.exit(0)": "import sys\nsys.exit(0)\n",
    "exit()": "exit()\n",
    "exit inside the test": "import sys\ndef f(x):\n    sys.exit(0)\n",
    "os._exit inside the test": "import os\ndef f(x):\n    os._exit(0)\n",
    "KeyboardInterrupt inside the test": "def f(x):\n    raise KeyboardInterrupt\n",
    "patched builtins": (
        "import builtins\n"
        "builtins.exec = lambda *args, **kwargs: None\n"
        "builtins.compile = lambda *args, **kwargs: compile('pass', '<x>', 'exec')\n"
        "builtins.enumerate = lambda items: [(index, 'pass') for index in range(len(items))]\n"
        "builtins.len = lambda items: 0\n"
        "builtins.BaseException = ZeroDivisionError\n"
        "builtins.print = lambda *args, **kwargs: None\n"
    ),
    "patched os and sys": (
        "import os, sys\n"
        "os.read = lambda fd, n: b'x' * n\n"
        "os.write = lambda fd, data: len(data)\n"
        "os._exit = lambda status: None\n"
        "sys.settrace = sys.setprofile = lambda *args: None\n"
    ),
    "printed success markers": (
        "import sys\n"
        "for index in range(2):\n"
        "    for line in (f'{index}', f'0 {index}', f'{\"0\" * 32} {index}', f'passed {index}', f'test {index} ok'):\n"
        "        print(line, flush=True)\n"
        "        print(line, file=sys.__stdout__, flush=True)\n"
    ),
    "marker looked up in the harness": (
        "import sys, __main__\n"
        "found = [value for value in vars(__main__).values() if isinstance(value, (str, bytes))]\n"
        "frame = sys._getframe()\n"
        "while frame is not None:\n"
        "    found += [value for value in frame.f_locals.values() if isinstance(value, (str, bytes))]\n"
        "    frame = frame.f_back\n"
        "found.append(sys.stdin.read())\n"
        "for value in found:\n"
        "    text = value.decode(errors='replace') if isinstance(value, bytes) else value\n"
        "    for token in text.split():\n"
        "        for index in range(2):\n"
        "            print(token[:32], index, flush=True)\n"
    ),
    "trace hook that skips the assert": (
        "import sys\n"
        "def tracer(frame, event, arg):\n"
        "    if frame.f_code.co_filename.startswith('<test'):\n"
        "        raise SystemExit(0)\n"
        "    return tracer\n"
        "sys.settrace(tracer)\n"
    ),
}


@pytest.mark.parametrize("hack", list(_HACKS), ids=list(_HACKS))
def test_reward_hacks_never_count_as_passing(hack):
    reward = get_code_execution_reward(timeout_s=5.0, sandbox="process")  # the harness is the same in both
    tests = ["assert f(1) == 2", "assert f(2) == 3"]
    correct = "def f(x):\n    return x + 1\n"
    code = _HACKS[hack]
    completion = code + _WRONG if "def f" not in code else code
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*weaker 'process' sandbox")
        assert reward(completions=[completion, correct], tests=[tests, tests]) == [0.0, 1.0]
