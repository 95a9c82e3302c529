"""A vLLM server that goes away mid-run, played by a small HTTP server on 127.0.0.1 that speaks the routes the
client uses and can crash, stay down, and come back on the same port with its start-up weights (no vLLM needed;
the real server's restart is in test_vllm_server.py). Its "model" is one weight `w`, and every completion is the
token `w` of the weights it holds, so a test sees exactly which weights sampled each completion."""

from __future__ import annotations

import json
import logging
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import torch

from posttrain.generation import SamplingParams
from posttrain.generation.vllm_backend import VLLMServerBackend
from posttrain.generation.vllm_client import VLLMClient, VLLMServerError
from posttrain.generation.vllm_worker import PROTOCOL_VERSION

SAMPLING = SamplingParams(max_tokens=1)


class _Policy(torch.nn.Module):
    def __init__(self, w: float) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.tensor([w]))


class _RestartableServer:
    """The fake server. `crash_on(path)`: the next request to `path` is dropped unanswered and the server goes
    down, to come back after `down_s` seconds (never with None) holding its start-up weights (w = 0)."""

    def __init__(self, model: str = "m", vocab_size: int = 64) -> None:
        self.model, self.vocab_size = model, vocab_size
        self.port = 0
        self.reloads: list[tuple[str, str | None]] = []  # (path, version) of every reload, all lives
        self._crash: tuple[str, float | None] | None = None
        self._server: ThreadingHTTPServer | None = None
        self.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        self.w, self.version = 0, None  # a (re)started server has its start-up weights
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):
                outer._answer(self, None)

            def do_POST(self):
                outer._answer(self, json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}"))

            def log_message(self, *args):
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", self.port), Handler)
        self._server.daemon_threads, self._server.block_on_close = True, False
        self.port = self._server.server_address[1]
        threading.Thread(target=self._server.serve_forever, daemon=True).start()

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None

    def restart(self) -> None:
        self.stop()
        self.start()

    def crash_on(self, path: str, down_s: float | None) -> None:
        self._crash = (path, down_s)

    def _answer(self, handler: BaseHTTPRequestHandler, body: dict | None) -> None:
        path = handler.path.split("?")[0]
        if self._crash is not None and self._crash[0] in (path, (body or {}).get("method")):
            _, down_s = self._crash
            self._crash = None
            handler.close_connection = True  # dropped without an answer, as by a process that dies
            threading.Thread(target=self._go_down, args=(down_s,), daemon=True).start()
            return
        status, answer = 200, self._route(path, body)
        if answer is None:
            status, answer = 404, {"detail": "Not Found"}
        payload = json.dumps(answer).encode()
        handler.send_response(status)
        handler.send_header("Content-Length", str(len(payload)))
        handler.end_headers()
        handler.wfile.write(payload)

    def _go_down(self, down_s: float | None) -> None:
        self.stop()
        if down_s is not None:
            time.sleep(down_s)
            self.start()

    def _route(self, path: str, body: dict | None):
        if path in ("/health", "/pause", "/resume", "/reset_prefix_cache"):
            return {}
        if path == "/version":
            return {"version": "0.32.0"}
        if path == "/v1/models":
            return {"data": [{"id": self.model}]}
        if path == "/v1/completions":
            return {
                "choices": [
                    {"index": i, "token_ids": [self.w], "logprobs": {"token_logprobs": [-0.5]}}
                    for i in range(body["n"])
                ]
            }
        if path == "/collective_rpc":
            return {"results": [self._rpc(body["method"], body["args"])]}
        return None

    def _rpc(self, method: str, args: list):
        if method == "posttrain_handshake":
            return {
                "protocol": PROTOCOL_VERSION,
                "max_model_len": 64,
                "dtype": "float32",
                "vocab_size": self.vocab_size,
            }
        if method == "posttrain_weights_version":
            return {"version": self.version, "reloads": len(self.reloads)}
        if method == "posttrain_reload_from_path":
            from safetensors.torch import load_file

            self.w = int(load_file(f"{args[0]}/model.safetensors")["w"].item())
            self.version = args[1]
            self.reloads.append((args[0], args[1]))
            return {"seconds": 0.0}
        raise AssertionError(method)


@pytest.fixture()
def server():
    fake = _RestartableServer()
    yield fake
    fake.stop()


def _backend(url: str, tmp_path, **kwargs) -> VLLMServerBackend:
    return VLLMServerBackend(
        VLLMClient(url, timeout_s=10, connect_timeout_s=10), [99], sync_dir=tmp_path, vocab_size=64, **kwargs
    )


def _sampled(backend: VLLMServerBackend) -> list[int]:
    """The weight that sampled each completion (2 prompts x 2 completions)."""
    return [c.token_ids[0] for c in backend.generate([[1, 2], [3]], 2, SAMPLING, seed=[1, 2])]


def _warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]


def test_a_server_that_crashes_mid_round_is_waited_for_and_gets_the_last_pushed_weights_again(server, tmp_path, caplog):
    backend = _backend(server.url, tmp_path)
    policy = _Policy(5.0)
    backend.sync_weights(policy)
    assert _sampled(backend) == [5] * 4
    with torch.no_grad():
        policy.w.fill_(7.0)  # trained on since the last push, not pushed: the server must get 5 back, not 7
    server.crash_on("/v1/completions", down_s=1.5)
    caplog.clear()
    started = time.monotonic()
    assert _sampled(backend) == [5] * 4  # the round is sent again, to the restarted server, after the re-push
    assert time.monotonic() - started >= 1.5
    assert backend.reconnects == 1 and backend.pop_metrics() == {"vllm/reconnects": 1.0}
    assert backend.pop_metrics() == {"vllm/reconnects": 0.0}
    assert server.reloads[-1] == (str(tmp_path), backend._version) and len(server.reloads) == 2
    # one warning when the server went away (however many requests failed), one when it is back
    messages = _warnings(caplog)
    assert len(messages) == 2, messages
    assert "could not reach the vLLM server" in messages[0] and "generation round 2" in messages[0]
    assert "Waiting up to 10 s" in messages[0]
    assert messages[1].startswith(f"Reconnected to the vLLM server at {server.url}") and "again" in messages[1]
    backend.sync_weights(policy)  # and the run goes on: the next push reaches the restarted server
    assert _sampled(backend) == [7] * 4 and backend.reconnects == 1


def test_a_server_restarted_between_two_requests_is_noticed_by_the_weights_version(server, tmp_path, caplog):
    backend = _backend(server.url, tmp_path)
    backend.sync_weights(_Policy(3.0))
    assert _sampled(backend) == [3] * 4
    server.restart()  # down and up again while the trainer was busy elsewhere: no request ever failed
    caplog.clear()
    assert _sampled(backend) == [3] * 4  # without the version check these would come from w = 0
    assert backend.reconnects == 1 and len(server.reloads) == 2
    (message,) = _warnings(caplog)
    assert "no longer holds the weights pushed last" in message and "restarted" in message


def test_before_the_first_push_a_restart_needs_no_reload(server, tmp_path):
    backend = _backend(server.url, tmp_path)
    server.crash_on("/v1/completions", down_s=0.5)
    assert _sampled(backend) == [0] * 4
    assert backend.reconnects == 1 and server.reloads == []


def test_a_crash_during_a_weight_sync_is_recovered_and_the_sync_completes(server, tmp_path):
    backend = _backend(server.url, tmp_path)
    server.crash_on("posttrain_reload_from_path", down_s=1.0)
    backend.sync_weights(_Policy(4.0))
    assert backend.reconnects == 1 and server.version == backend._version
    assert _sampled(backend) == [4] * 4


def test_a_server_that_does_not_come_back_stops_the_run_with_the_original_error(server, tmp_path):
    backend = _backend(server.url, tmp_path, reconnect_timeout_s=2)
    backend.sync_weights(_Policy(1.0))
    server.crash_on("/v1/completions", down_s=None)
    started = time.monotonic()
    with pytest.raises(VLLMServerError) as error:
        _sampled(backend)
    assert 2 <= time.monotonic() - started < 10
    message = str(error.value)
    assert f"could not reach the vLLM server at {server.url}" in message
    assert "generation round 1, at optimizer step 0" in message
    assert "did not come back within 2 s (vllm_server_timeout)" in message
    assert backend.reconnects == 0


def test_a_server_that_comes_back_with_another_model_is_refused(server, tmp_path):
    backend = _backend(server.url, tmp_path)
    backend.sync_weights(_Policy(1.0))
    server.crash_on("/v1/completions", down_s=0.5)
    server.model = "another"
    with pytest.raises(VLLMServerError, match="came back serving 'another'.*instead of 'm'"):
        _sampled(backend)
