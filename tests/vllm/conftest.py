"""Fixtures for the tests against a real vLLM engine (run them in the vLLM environment: see docs/vllm.md).

The models are tiny Llamas with head_dim 32: vLLM's CPU attention kernels need a head size of at least 32,
so the default tiny model of the other tests (head_dim 8) does not load.
"""

from __future__ import annotations

import os
import socket
import subprocess
import time
from pathlib import Path

import pytest

SERVER_START_TIMEOUT_S = 600.0  # a start takes 30-80 s on a quiet 2-core machine, minutes on a loaded one


@pytest.fixture(scope="session")
def vllm_tiny_path(tmp_path_factory) -> str:
    """Tied embeddings, like SmolLM2: the case where a naive weight reload on CPU goes wrong."""
    from posttrain.models.tiny import save_tiny_model

    return save_tiny_model(tmp_path_factory.mktemp("vllm-tiny") / "tied", hidden_size=128)


@pytest.fixture(scope="session")
def vllm_tiny_untied_path(tmp_path_factory) -> str:
    from posttrain.models.tiny import save_tiny_model

    return save_tiny_model(tmp_path_factory.mktemp("vllm-tiny") / "untied", hidden_size=128, tie=False, seed=1)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture()
def unused_port() -> int:
    return free_port()


class ServerProcess:
    """A `posttrain vllm-serve` server on 127.0.0.1; `ensure()` (re)starts it when it is not running, so a
    test may kill it, and `restart()` starts it again on the port it had, as an operator would."""

    def __init__(self, model_path: str, workdir: Path, extra: tuple[str, ...] = ()) -> None:
        self.model_path, self.workdir, self.extra = model_path, workdir, extra
        self.process: subprocess.Popen | None = None
        self.url = ""
        self.port = 0

    def ensure(self) -> str:
        if self.process is not None and self.process.poll() is None:
            return self.url
        return self.start(free_port())

    def restart(self) -> str:
        return self.start(self.port)

    def start(self, port: int) -> str:
        from posttrain.cli.vllm_serve import build_server_command
        from posttrain.generation.vllm_client import VLLMClient

        self.port = port
        command, env = build_server_command(
            [
                self.model_path,
                "--host",
                "127.0.0.1",  # tests bind loopback only (the command's default is TRL's 0.0.0.0)
                "--port",
                str(port),
                "--max-model-len",
                "512",
                "--dtype",
                "float32",
                "--kv-cache-gb",
                "0.25",
                "--cache-dir",
                str(self.workdir / "cache"),
                *self.extra,
            ]
        )
        log = open(self.workdir / f"server-{port}.log", "a")  # a restart on the same port appends
        self.process = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        self.url = f"http://127.0.0.1:{port}"
        try:
            VLLMClient(self.url).wait_until_ready(SERVER_START_TIMEOUT_S)
        except Exception:
            self.stop()
            raise RuntimeError(
                f"the test vLLM server did not start; see {log.name}:\n" + Path(log.name).read_text()[-3000:]
            ) from None
        return self.url

    def kill(self) -> None:
        """SIGKILL to the server's process group (the API server and its engine core), as in a crash."""
        os.killpg(self.process.pid, 9)
        self.process.wait(30)

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            os.killpg(self.process.pid, 15)
            try:
                self.process.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, 9)
                self.process.wait(30)


@pytest.fixture(scope="session")
def vllm_server_process(vllm_tiny_path, tmp_path_factory):
    pytest.importorskip("vllm")
    server = ServerProcess(vllm_tiny_path, tmp_path_factory.mktemp("vllm-server"))
    yield server
    server.stop()


@pytest.fixture()
def vllm_server(vllm_server_process) -> str:
    """The URL of a running test server (started once per session, restarted if a test killed it)."""
    started = time.monotonic()
    url = vllm_server_process.ensure()
    if time.monotonic() - started > 1:
        print(f"vLLM test server started in {time.monotonic() - started:.0f} s")
    return url
