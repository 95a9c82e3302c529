"""The GPU check's vLLM step: server mode's NCCL weight sync (posttrain/generation/vllm_nccl_sync.py) for real.

Starts `posttrain vllm-serve MODEL --weight-transfer nccl` on GPU 1 (float32, a 2 GiB KV cache), builds the
trainer's model on GPU 0 with other weights than the server's (the start-up weights plus seeded noise), and then:
- syncs through the new path (`VLLMServerBackend` finds NCCL at the handshake), 3 times, timing each;
- checks the server against the trainer after the sync: its greedy completion of each prompt equals the trainer's
  greedy decoding, and its log-prob of each token of a seeded sample is within 1e-3 nats of the trainer's (both
  float32); before the sync they differ (else the check could not fail);
- times the file sync (safetensors through /tmp) to the same server, 3 times, for comparison.
Skipped, with a line saying why, where vLLM is not installed or fewer than 2 CUDA devices are visible (--dry-run
included): NCCL refuses two ranks of one group on one device ("Duplicate GPU detected"), so the server and the
trainer need a GPU each, as in TRL's server mode. `run(...)` returns the report's "vllm_sync" entry; gpu_check.py
calls it after the training runs.
"""

from __future__ import annotations

import importlib.util
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

PROMPTS = ([1, 2, 3, 4, 5], [17, 4, 60, 25, 3, 8], [40, 12, 7])  # ids every vocabulary has
GREEDY_TOKENS = 12
LOGP_TOLERANCE = 1e-3  # nats, float32 on both sides
REPEATS = 3


def skip_reason(dry_run: bool) -> str | None:
    """Why the step cannot run here, or None."""
    import torch

    if dry_run or not torch.cuda.is_available():
        return "skipped: needs 2 CUDA GPUs (NCCL moves GPU memory); the CPU tests cover the sync's logic"
    if torch.cuda.device_count() < 2:
        return (
            f"skipped: needs 2 CUDA GPUs, {torch.cuda.device_count()} visible (NCCL refuses two ranks of one group "
            "on one device: the server and the trainer need a GPU each)"
        )
    if importlib.util.find_spec("vllm") is None:
        return (
            "skipped: vLLM is not installed in this Python; install the vLLM wheel (the server's release, 0.32) "
            "to run the NCCL weight-sync step"
        )
    return None


def compare(trainer: list[dict], server: list[dict], tolerance: float = LOGP_TOLERANCE) -> dict:
    """Per prompt, {"greedy": tokens, "logprobs": of the server's sampled tokens} from each side (the trainer's
    log-probs scored on the server's samples): whether the greedy tokens agree, and the largest log-prob gap."""
    same = all(t["greedy"] == s["greedy"] for t, s in zip(trainer, server, strict=True))
    diffs = [abs(a - b) for t, s in zip(trainer, server) for a, b in zip(t["logprobs"], s["logprobs"], strict=True)]
    worst = max(diffs, default=float("inf"))
    return {"tokens_equal": same, "max_logp_diff": worst, "match": same and worst <= tolerance}


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _server_side(client, prompts) -> list[dict]:
    """The server's greedy completion of each prompt, and a seeded sample with its log-probs (EOS ignored, so
    both sides run the full length)."""
    from posttrain.generation import SamplingParams

    sampling = SamplingParams(max_tokens=GREEDY_TOKENS, extra={"ignore_eos": True})
    out = []
    for prompt in prompts:
        greedy = client.complete(prompt, 1, sampling, None, [], temperature=0.0)[0]
        sample = client.complete(prompt, 1, sampling, 7, [])[0]
        out.append({"greedy": list(greedy.token_ids), "sample": list(sample.token_ids), "logprobs": sample.logprobs})
    return out


def _trainer_side(model, prompts, server: list[dict]) -> list[dict]:
    """The trainer's greedy decoding of each prompt (step by step, no EOS), its log-probs of the server's sample,
    and the smallest gap between the best two logits (a near tie may be broken either way by rounding)."""
    import torch

    out = []
    with torch.no_grad():
        for prompt, theirs in zip(prompts, server):
            ids, gap = list(prompt), float("inf")
            for _ in range(GREEDY_TOKENS):
                top = model(torch.tensor([ids], device=model.device)).logits[0, -1].double().topk(2)
                gap = min(gap, float(top.values[0] - top.values[1]))
                ids.append(int(top.indices[0]))
            sample = theirs["sample"]
            logits = model(torch.tensor([prompt + sample], device=model.device)).logits[0, len(prompt) - 1 : -1]
            index = torch.tensor(sample, device=model.device)[:, None]
            logps = torch.log_softmax(logits.double(), -1).gather(1, index)[:, 0]
            out.append({"greedy": ids[len(prompt) :], "logprobs": logps.tolist(), "gap": gap})
    return out


def _start_server(model_path: str, port: int, log: Path) -> subprocess.Popen:
    from posttrain.cli.vllm_serve import build_server_command

    argv = [
        model_path,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--dtype",
        "float32",
        "--kv-cache-gb",
        "2",
        "--max-model-len",
        "256",
    ]
    command, env = build_server_command([*argv, "--weight-transfer", "nccl", "--gpu-memory-utilization", "0.5"])
    env["CUDA_VISIBLE_DEVICES"] = "1"  # the trainer is on GPU 0
    with open(log, "w") as sink:
        return subprocess.Popen(command, env=env, stdout=sink, stderr=subprocess.STDOUT, start_new_session=True)


def _timed_syncs(backend, model) -> list[float]:
    import torch

    seconds = []
    for _ in range(REPEATS):
        torch.cuda.synchronize()
        started = time.perf_counter()
        backend.sync_weights(model, force=True)
        seconds.append(time.perf_counter() - started)
    return seconds


def _compared(model, client) -> dict:
    server = _server_side(client, PROMPTS)
    trainer = _trainer_side(model, PROMPTS, server)
    return {**compare(trainer, server), "min_top2_gap": min(t["gap"] for t in trainer)}


def _check(model_path: str, work: Path, result: dict) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    from posttrain.generation.vllm_backend import VLLMServerBackend
    from posttrain.generation.vllm_client import VLLMClient

    port = _free_port()
    server = _start_server(model_path, port, work / "vllm_server.log")
    result["server_log"] = str(work / "vllm_server.log")
    try:
        client = VLLMClient(f"http://127.0.0.1:{port}", timeout_s=120, connect_timeout_s=420)
        model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).cuda().eval()
        generator = torch.Generator(device="cuda").manual_seed(0)
        with torch.no_grad():  # other weights than the server's start-up ones
            for param in model.parameters():
                param.add_(torch.randn(param.shape, generator=generator, device="cuda") * 0.02)
        nccl = VLLMServerBackend(client, [], trainer_device=torch.device("cuda"), group_port=_free_port())
        result["path"] = "nccl" if nccl.nccl is not None else "files (NCCL not found at the handshake)"
        result["before_sync"] = _compared(model, client)
        result["nccl_sync_s"] = _timed_syncs(nccl, model)
        result["nccl_send_s"] = nccl.nccl.seconds if nccl.nccl is not None else None
        result["after_sync"] = _compared(model, client)
        files = VLLMServerBackend(client, [], sync_dir=str(work / "vllm_sync"))  # no trainer_device: files
        result["file_sync_s"] = _timed_syncs(files, model)
        result["after_file_sync"] = _compared(model, client)
        result["params"] = sum(p.numel() for p in model.parameters())
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        try:
            server.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)


def run(models: dict, dry_run: bool, work: Path) -> dict:
    """The step on the SmolLM2-135M-sized model of `models` ({name: (path, params)}; the first one in a dry run)."""
    reason = skip_reason(dry_run)
    if reason is not None:
        print(f"gpu_check vllm_sync: {reason}", flush=True)
        return {"skipped": reason}
    name = next((n for n in models if n.startswith("SmolLM2")), next(iter(models)))
    result: dict = {"model": name}
    started = time.perf_counter()
    try:
        _check(models[name][0], work, result)
        if not result["after_sync"]["match"] or result["before_sync"]["match"]:
            result["error"] = "the server's greedy completion or log-probs do not match the trainer's as expected"
    except Exception as error:  # reported, the other results kept
        result["error"] = f"{type(error).__name__}: {error}"
    result["total_s"] = time.perf_counter() - started
    return result


def markdown(result: dict) -> list[str]:
    """The step's lines for gpu_check.md."""
    if "skipped" in result:
        return ["", f"vLLM NCCL weight sync: {result['skipped']}."]
    lines = ["", f"vLLM NCCL weight sync ({result.get('model')}, float32, server and trainer on one GPU):"]
    for key in ("path", "nccl_sync_s", "nccl_send_s", "file_sync_s", "before_sync", "after_sync", "error"):
        if key in result:
            lines.append(f"- {key}: {result[key]}")
    return lines


if __name__ == "__main__":
    print("Run it through benchmarks/gpu_check.py.", file=sys.stderr)
    raise SystemExit(2)
