"""Server mode's NCCL weight sync from an FSDP2-sharded trainer (posttrain/generation/vllm_nccl_sync.py) on two CPU
processes over gloo, vLLM's engine and the server replaced by tests/_vllm_fakes.py: every rank gathers every
parameter, rank 0 alone talks to the server and sends the whole checkpoint, and a failed sync stops every rank
with the same error naming the server and the version. Run with `pytest -m dist`."""

from __future__ import annotations

import datetime
import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from _vllm_fakes import SYNC_CALLS

pytestmark = [pytest.mark.dist]
HOST = "127.0.0.1"


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind((HOST, 0))
        return sock.getsockname()[1]


def _rank(rank: int, model_path: str, port: int, out: str, fail: bool) -> None:
    from _vllm_fakes import FakeClient, FakeEngine, fake_engine_classes
    from torch.distributed.fsdp import fully_shard
    from transformers import AutoModelForCausalLM

    from posttrain.generation import vllm_nccl_sync
    from posttrain.generation.vllm_backend import VLLMServerBackend
    from posttrain.generation.vllm_client import VLLMServerError

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://{HOST}:{port}", rank=rank, world_size=2, timeout=datetime.timedelta(seconds=120)
    )
    FakeEngine.log, FakeEngine.sent, FakeEngine.block = [], [], None
    vllm_nccl_sync._vllm_engine = fake_engine_classes
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    expected = {n: t.clone() for n, t in model.state_dict().items() if n != "lm_head.weight"}
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    client = FakeClient(fail_on="update_weights" if fail and rank == 0 else None)
    server = VLLMServerBackend(client, [0], trainer_device=torch.device("cuda"), group_port=51998)
    report = {"rank": rank, "sharded": sum(hasattr(p, "full_tensor") for p in model.parameters())}
    try:
        server.sync_weights(model)
    except VLLMServerError as error:
        report["error"] = str(error)
    report["calls"] = [entry[0] for entry in client.log]
    report["version"] = f"{server._run_id}-1"
    if FakeEngine.sent:
        sent = FakeEngine.sent[0]
        report["names_equal"] = [name for name, _ in sent] == list(expected)
        report["equal"] = all(torch.equal(tensor, expected[name]) for name, tensor in sent)
    dist.barrier()
    torch.save(report, os.path.join(out, f"rank{rank}.pt"))
    dist.destroy_process_group()


def _run(model_path, tmp_path, fail: bool) -> list[dict]:
    mp.spawn(_rank, args=(str(model_path), _free_port(), str(tmp_path), fail), nprocs=2, join=True)
    return [torch.load(tmp_path / f"rank{rank}.pt") for rank in (0, 1)]


def test_every_rank_gathers_and_rank_0_alone_sends_the_whole_checkpoint(tiny_model_path, tmp_path):
    first, second = _run(tiny_model_path, tmp_path, fail=False)
    assert first["sharded"] > 0 and second["sharded"] == first["sharded"]
    assert first["version"] == second["version"]  # one version for the run, from rank 0
    assert first["calls"][-6:] == SYNC_CALLS
    assert first["names_equal"] and first["equal"]  # the unsharded checkpoint, tied weight once
    assert second["calls"] == ["wait_until_ready"] and "equal" not in second  # rank 1 never talks to the server
    assert "error" not in first and "error" not in second


def test_a_failed_sync_stops_every_rank_naming_the_server_and_the_version(tiny_model_path, tmp_path):
    first, second = _run(tiny_model_path, tmp_path, fail=True)
    assert first["error"] == second["error"]
    assert first["version"] in first["error"] and "http://127.0.0.1:8123" in first["error"]
    assert "HTTP 500: boom" in first["error"]
