"""A weight push from an FSDP2-sharded trainer (posttrain/online/weights/transport.py `gathered_params`,
weights/collective.py): every rank of the training group gathers every parameter's shards, all before any send,
and rank 0 alone sends; the worker then holds the unsharded model's flat buffers bit for bit. Two CPU processes
on gloo. Run with `pytest -m dist`. On a machine with 2 GPUs the same test runs the NCCL path (training group and
weight pair on NCCL, rank r on GPU r, the worker on GPU 1):
    POSTTRAIN_PUSH_BACKEND=nccl python -m pytest -m dist tests/dist/test_weight_push.py
"""

from __future__ import annotations

import datetime
import os
import socket
import threading

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from posttrain.online.weights.collective import PairReceiver, PairSender, open_store
from posttrain.online.weights.transport import flat_buffers, flat_layout, gathered_params, pack

pytestmark = [pytest.mark.dist]
HOST = "127.0.0.1"
VERSION = 7


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind((HOST, 0))
        return sock.getsockname()[1]


BACKEND = os.environ.get("POSTTRAIN_PUSH_BACKEND", "gloo")


def _receive(port: int, layout, into: dict, backend: str) -> None:
    if backend == "nccl":
        torch.cuda.set_device(1)  # a pair's two ends on two GPUs
    receiver = PairReceiver(HOST, port, "worker", 60, backend)
    into["buffers"] = flat_buffers(layout)
    into["version"] = receiver.receive(into["buffers"])


def _rank(rank: int, model_path: str, port: int, out: str, backend: str) -> None:
    from torch.distributed.fsdp import fully_shard
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(1)
    if backend == "nccl":
        torch.cuda.set_device(rank)
    dist.init_process_group(
        backend, init_method=f"tcp://{HOST}:{port}", rank=rank, world_size=2, timeout=datetime.timedelta(seconds=120)
    )
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    layout = flat_layout(model)
    expected = pack([p for _, p in model.named_parameters()], flat_buffers(layout))
    if backend == "nccl":
        model.cuda()
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    sharded = [name for name, p in model.named_parameters() if hasattr(p, "full_tensor")]
    params = gathered_params(model)  # every rank, in the same order: a collective of the training group
    report = {"rank": rank, "sharded": len(sharded), "gathered": len(params)}
    if rank == 0:
        store, got = open_store(HOST, 60), {}
        worker = threading.Thread(target=_receive, args=(store.port, layout, got, backend))
        worker.start()
        sender = PairSender(store, HOST, "worker", 60, backend)
        sender.send(pack(params, flat_buffers(layout)), VERSION)
        worker.join(60)
        report["version"] = got["version"]
        report["equal"] = {str(d): torch.equal(got["buffers"][d], expected[d]) for d in expected}
    dist.barrier()
    torch.save(report, os.path.join(out, f"rank{rank}.pt"))
    dist.destroy_process_group()


def test_fsdp2_shards_are_gathered_on_every_rank_and_rank_0_sends_them_whole(tiny_model_path, tmp_path):
    mp.spawn(_rank, args=(str(tiny_model_path), _free_port(), str(tmp_path), BACKEND), nprocs=2, join=True)
    reports = [torch.load(tmp_path / f"rank{rank}.pt") for rank in (0, 1)]
    assert all(r["sharded"] > 0 and r["gathered"] == reports[0]["gathered"] for r in reports)
    assert reports[0]["version"] == VERSION
    assert reports[0]["equal"] and all(reports[0]["equal"].values()), reports[0]["equal"]
