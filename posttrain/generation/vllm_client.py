"""A client for a vLLM server started with `posttrain vllm-serve` (server mode).

It speaks plain HTTP with the standard library, so the trainer's environment does not need vLLM:
generation goes through `/v1/completions` with prompt token ids; weights go through the development
routes (`/pause`, `/collective_rpc`, `/reset_prefix_cache`, `/resume`, and for GPUs the weight-transfer
routes). Every request has a timeout, and every failure raises `VLLMServerError` naming the server's URL,
what was being done (and the training step, when the caller gives one) and what went wrong, so a dead or
unreachable server stops training with a message instead of a hang. A server that cannot be reached at all
(connection refused or reset: stopped or restarting) raises the subclass `VLLMServerUnreachable`, which
the server backend answers by waiting for the server to come back.
"""

from __future__ import annotations

import http.client
import json
import logging
import re
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from posttrain.generation.base import Completion, SamplingParams
from posttrain.generation.openai_format import parse_logprobs, pil_to_base64, to_openai_messages  # noqa: F401
from posttrain.generation.vllm_worker import PROTOCOL_VERSION

logger = logging.getLogger(__name__)

TESTED_VLLM_VERSION = "0.32.0"
MIN_VLLM_VERSION = (0, 32)  # the release whose routes and worker API this client was written against
WORKER_EXTENSION = "posttrain.generation.vllm_worker.PosttrainWorkerExtension"
SERVE_HINT = "start it with `posttrain vllm-serve MODEL --host HOST --port PORT` (in the vLLM environment)"


class VLLMServerError(RuntimeError):
    """The vLLM server could not be reached, answered with an error, or is not set up for posttrain."""


class VLLMServerUnreachable(VLLMServerError):
    """No connection to the vLLM server (refused, reset, closed mid-answer): it is down or restarting. Unlike an
    HTTP error or a timeout, waiting for it can help."""


class VLLMClient:
    """Talks to one vLLM server at `base_url` (e.g. "http://127.0.0.1:8000").

    `timeout_s` bounds every request (a generation request included: it must cover the longest batch);
    `connect_timeout_s` bounds the wait for the server to come up in `wait_until_ready`.
    """

    def __init__(self, base_url: str, timeout_s: float = 600.0, connect_timeout_s: float = 240.0) -> None:
        self.base_url = base_url.rstrip("/")
        self.timeout_s = timeout_s
        self.connect_timeout_s = connect_timeout_s
        self.model_name: str | None = None
        self.server_info: dict[str, Any] = {}
        # Local servers are the rule: never send their traffic through an HTTP proxy from the environment.
        self._opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))

    # -- plumbing ------------------------------------------------------------------------------------------
    def request(
        self,
        method: str,
        path: str,
        body: dict | None = None,
        *,
        what: str,
        context: str = "",
        timeout_s: float | None = None,
    ) -> Any:
        """One HTTP request; the decoded JSON answer (None when empty). `what` and `context` name the
        operation in the error raised on failure."""
        url = self.base_url + path
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(url, data=data, method=method, headers={"Content-Type": "application/json"})
        timeout = self.timeout_s if timeout_s is None else timeout_s
        where = f" ({context})" if context else ""
        try:
            with self._opener.open(request, timeout=timeout) as response:
                raw = response.read()
        except urllib.error.HTTPError as err:
            raise VLLMServerError(
                f"{what}{where} failed: the vLLM server at {url} answered HTTP {err.code}: {_error_detail(err)}"
            ) from None
        except TimeoutError:
            raise VLLMServerError(
                f"{what}{where} failed: the vLLM server at {url} did not answer within "
                f"{timeout:g} s. Raise the client timeout if the server is just slow."
            ) from None
        except (urllib.error.URLError, http.client.HTTPException, OSError) as err:
            reason = getattr(err, "reason", None) or err
            raise VLLMServerUnreachable(
                f"{what}{where} failed: could not reach the vLLM server at {url} ({reason}). "
                f"Is it running? If not, {SERVE_HINT}."
            ) from None
        try:
            return json.loads(raw) if raw else None
        except json.JSONDecodeError:
            raise VLLMServerError(f"{what}{where}: the answer of {url} is not JSON: {raw[:200]!r}") from None

    def collective_rpc(
        self, method: str, args: Sequence[str] = (), *, what: str, context: str = "", timeout_s: float | None = None
    ) -> list:
        """Calls `method` on every vLLM worker; returns the workers' results."""
        timeout = self.timeout_s if timeout_s is None else timeout_s
        body = {"method": method, "args": list(args), "timeout": timeout}
        answer = self.request("POST", "/collective_rpc", body, what=what, context=context, timeout_s=timeout + 10)
        return (answer or {}).get("results", [])

    # -- start-up -------------------------------------------------------------------------------------------
    def wait_until_ready(self, timeout_s: float | None = None) -> dict[str, Any]:
        """Polls `/health` until the server answers (at most `timeout_s`, default connect_timeout_s), then
        checks that it can serve posttrain (`handshake`). Returns the server's description."""
        timeout = self.connect_timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + timeout
        while True:
            try:
                self.request("GET", "/health", what="health check", timeout_s=5.0)
                break
            except VLLMServerError as err:
                if time.monotonic() >= deadline:
                    raise VLLMServerError(
                        f"The vLLM server at {self.base_url} was not ready within {timeout:g} s (last attempt: {err})."
                    ) from None
                time.sleep(1.0)
        return self.handshake()

    def handshake(self) -> dict[str, Any]:
        """Checks the vLLM version, the development routes and posttrain's worker extension; remembers the
        served model's name. Raises VLLMServerError naming what to change."""
        version = self.request("GET", "/version", what="reading the vLLM version")["version"]
        if _major_minor(version) < MIN_VLLM_VERSION:
            raise VLLMServerError(
                f"The vLLM server at {self.base_url} runs vLLM {version}; posttrain needs vLLM >= "
                f"{'.'.join(map(str, MIN_VLLM_VERSION))} (tested with {TESTED_VLLM_VERSION}). Upgrade the server's "
                "vLLM."
            )
        if _major_minor(version) != _major_minor(TESTED_VLLM_VERSION):
            logger.warning(
                "The vLLM server at %s runs vLLM %s; posttrain was tested with %s.",
                self.base_url,
                version,
                TESTED_VLLM_VERSION,
            )
        models = self.request("GET", "/v1/models", what="listing the served model")["data"]
        try:
            results = self.collective_rpc(
                "posttrain_handshake", what="checking posttrain's worker extension", timeout_s=60.0
            )
        except VLLMServerError as err:
            if "HTTP 404" in str(err):
                raise VLLMServerError(
                    f"The vLLM server at {self.base_url} has no /collective_rpc route: it was started without "
                    f"VLLM_SERVER_DEV_MODE=1. Restart it; `posttrain vllm-serve` sets it."
                ) from None
            raise VLLMServerError(
                f"The vLLM server at {self.base_url} does not have posttrain's worker extension ({err}). Restart it "
                f"with --worker-extension-cls {WORKER_EXTENSION}; `posttrain vllm-serve` sets it."
            ) from None
        info = results[0]
        if info.get("protocol") != PROTOCOL_VERSION:
            raise VLLMServerError(
                f"Version mismatch: the vLLM server at {self.base_url} runs posttrain's worker extension protocol "
                f"{info.get('protocol')}, this trainer speaks protocol {PROTOCOL_VERSION}. Install the same posttrain "
                "version in the server's and the trainer's environments and restart the server."
            )
        self.model_name = models[0]["id"]
        self.server_info = {**info, "vllm_version": version, "model": self.model_name}
        return self.server_info

    # -- generation -----------------------------------------------------------------------------------------
    def complete(
        self,
        prompt_ids: Sequence[int],
        n: int,
        sampling: SamplingParams,
        seed: int | None,
        stop_token_ids: Sequence[int],
        prompt_index: int = 0,
        context: str = "",
        temperature: float | None = None,
    ) -> list[Completion]:
        """`n` completions of one prompt (token ids in, token ids and the sampler's log-probs out).

        `temperature` overrides sampling.temperature (0 is greedy decoding, which SamplingParams forbids
        for training but a check may want)."""
        if self.model_name is None:
            self.handshake()
        body = {
            "model": self.model_name,
            "prompt": list(prompt_ids),
            "n": n,
            "max_tokens": sampling.max_tokens,
            "temperature": sampling.temperature if temperature is None else temperature,
            "top_p": sampling.top_p,
            "top_k": sampling.top_k,
            "min_p": sampling.min_p,
            "repetition_penalty": sampling.repetition_penalty,
            "stop_token_ids": list(stop_token_ids),
            "logprobs": 0,
            "return_token_ids": True,
            "skip_special_tokens": False,
        }
        body.update(sampling.extra)
        if sampling.regex is not None:
            body["structured_outputs"] = {"regex": sampling.regex}
        if seed is not None:
            body["seed"] = seed
        answer = self.request("POST", "/v1/completions", body, what="generation", context=context)
        choices = sorted(answer["choices"], key=lambda c: c["index"])
        return [
            completion_from_output(prompt_index, c["token_ids"], c["logprobs"]["token_logprobs"], stop_token_ids)
            for c in choices
        ]

    def generate(
        self,
        prompt_ids: Sequence[Sequence[int]],
        n: int,
        sampling: SamplingParams,
        seeds: Sequence[int] | None,
        stop_token_ids: Sequence[int],
        context: str = "",
    ) -> list[Completion]:
        """`n` completions per prompt, prompt-major. One request per prompt, all sent at once so that the
        server batches them; `seeds` has one seed per prompt (or None)."""
        if not prompt_ids:
            return []
        seeds = list(seeds) if seeds is not None else [None] * len(prompt_ids)
        pool = ThreadPoolExecutor(max_workers=min(len(prompt_ids), 64))
        try:
            futures = [
                pool.submit(self.complete, ids, n, sampling, seed, stop_token_ids, i, context)
                for i, (ids, seed) in enumerate(zip(prompt_ids, seeds))
            ]
            return [completion for future in futures for completion in future.result()]
        finally:  # after a failure, requests not yet sent are dropped rather than each waiting for a timeout
            pool.shutdown(wait=False, cancel_futures=True)

    # -- weight sync, portable path ------------------------------------------------------------------------
    def reload_weights(self, directory: str, context: str = "", version: str | None = None) -> None:
        """Makes the server load the safetensors files in `directory` (which it must be able to read), and
        remember them as `version`: generation is paused (in-flight requests finish first), the weights are
        reloaded, the prefix cache (KV blocks computed with the old weights) is reset, and generation resumes,
        also after a failure."""
        self.pause(context)
        try:
            self.collective_rpc(
                "posttrain_reload_from_path",
                [directory, version],
                context=context,
                what=f"reloading the weights from {directory}",
            )
            self.reset_prefix_cache(context)
        finally:
            self.resume(context)

    def weights_version(self, context: str = "") -> dict[str, Any]:
        """The server's `{"version", "reloads"}` (see `PosttrainWorkerExtension.posttrain_weights_version`);
        with several workers (tensor parallelism) they hold the same weights, so the first one answers."""
        return self.collective_rpc(
            "posttrain_weights_version", what="asking which weights the server holds", context=context, timeout_s=60.0
        )[0]

    def reset_prefix_cache(self, context: str = "", attempts: int = 20) -> None:
        """Resets the prefix cache; vLLM refuses while KV blocks are held, so it is retried briefly."""
        for _ in range(attempts):
            answer = self.request("POST", "/reset_prefix_cache", {}, what="resetting the prefix cache", context=context)
            if answer is None or answer.get("success", True):
                return
            time.sleep(0.25)
        raise VLLMServerError(
            f"resetting the prefix cache ({context}) failed: the vLLM server at {self.base_url} "
            f"still held KV blocks after {attempts} attempts; old-weight KV entries could be reused."
        )

    # -- weight sync, GPU fast path (NCCL): vLLM's weight-sync client protocol -----------------------------------
    # vLLM's trainer-side engine (vllm.distributed.weight_transfer.nccl_engine) drives the first four calls, through
    # vllm_nccl_sync.py, which names the sync and its version in `context`. Each is bounded by timeout_s.
    def init_weight_transfer_engine(self, init_info: dict[str, Any], context: str = "") -> None:
        what = "joining the NCCL weight-transfer group (--weight-transfer nccl)"
        self.request("POST", "/init_weight_transfer_engine", {"init_info": init_info}, what=what, context=context)

    def start_weight_update(self, context: str = "") -> None:
        self.request("POST", "/start_weight_update", {}, what="starting a weight update (NCCL)", context=context)

    def update_weights(self, update_info: dict[str, Any], context: str = "") -> None:
        body = {"update_info": update_info}
        self.request("POST", "/update_weights", body, what="receiving the weights (NCCL)", context=context)

    def finish_weight_update(self, weight_version: str | None = None, context: str = "") -> None:
        body = {"weight_version": weight_version}
        self.request("POST", "/finish_weight_update", body, what="finishing a weight update (NCCL)", context=context)

    def shutdown_weight_transfer_engine(self, context: str = "") -> None:
        what = "shutting down the NCCL weight transfer"
        self.request("POST", "/shutdown_weight_transfer_engine", {}, what=what, context=context)

    def world_size(self, context: str = "") -> int:
        """How many workers the server runs (tensor x pipeline x data parallel): the NCCL group is them plus the
        trainer's rank 0."""
        return int(
            self.request("GET", "/get_world_size", what="reading the server's world size", context=context)[
                "world_size"
            ]
        )

    def engine_weight_version(self, context: str = "") -> str | None:
        """vLLM's own weight version, set by `finish_weight_update` ("default" after a start)."""
        answer = self.request("GET", "/weight_info", what="asking which weights the server holds", context=context)
        return answer.get("weight_version")

    def pause(self, context: str = "") -> None:
        """Pauses generation for a weight sync; in-flight requests finish first."""
        self.request("POST", "/pause?mode=wait", {}, what="pausing generation for a weight sync", context=context)

    def resume(self, context: str = "") -> None:
        self.request("POST", "/resume", {}, what="resuming generation after a weight sync", context=context)


def completion_from_output(
    prompt_index: int, token_ids: Sequence[int], logprobs: Sequence[float] | None, stop_token_ids: Sequence[int]
) -> Completion:
    """A Completion from vLLM's output; it ended with EOS when its last token is a stop token (vLLM keeps
    the stop token in the output ids)."""
    token_ids = list(token_ids)
    finished = bool(token_ids) and token_ids[-1] in set(stop_token_ids)
    return Completion(prompt_index, token_ids, None if logprobs is None else [float(x) for x in logprobs], finished)


def _error_detail(err: urllib.error.HTTPError) -> str:
    """The server's error message out of its JSON error body, else the raw body."""
    raw = err.read()
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, ValueError):
        return raw[:500].decode(errors="replace") or str(err.reason)
    error = body.get("error", body.get("detail", body)) if isinstance(body, dict) else body
    message = error.get("message", error) if isinstance(error, dict) else error
    return str(message)[:500]


def _major_minor(version: str) -> tuple[int, ...]:
    return tuple(int(number) for number in re.findall(r"\d+", version)[:2])
