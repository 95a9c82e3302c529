"""posttrain's NCCL sync driving vLLM's own trainer-side engine (`NCCLTrainerWeightTransferEngine`, vLLM 0.32) on
CPU: everything of vLLM's runs (the init handshake and its worker payload, the order of the control-plane calls,
the check that `metadata()` agrees with iteration, and the packing of the tensors into uint8 chunks) except the
NCCL broadcast itself, which needs a GPU: each packed chunk is handed over in memory and unpacked with vLLM's
`unpack_tensor` from the update info the server was sent, as a worker would. benchmarks/gpu_check.py runs the
real broadcast (docs/gpu.md)."""

from __future__ import annotations

import pytest
import torch
from _vllm_fakes import SYNC_CALLS, WORKERS, FakeClient

from posttrain.generation.vllm_backend import VLLMServerBackend

pytestmark = pytest.mark.vllm
nccl_engine = pytest.importorskip("vllm.distributed.weight_transfer.nccl_engine")
packed_tensor = pytest.importorskip("vllm.distributed.weight_transfer.packed_tensor")


class Worker:
    """The server's side: the init payload it got, and the tensors it unpacked from the chunks."""

    def __init__(self):
        self.init_payload, self.received, self.chunks, self.destroyed = None, [], 0, 0


@pytest.fixture
def worker(monkeypatch):
    """vLLM's engine with only the NCCL group replaced: its endpoint, and the broadcast of each packed chunk."""
    server = Worker()

    class Group:
        def destroy(self):
            server.destroyed += 1

    def broadcast(iterator, group, src, post_iter_func, buffer_size_bytes, num_buffers):
        assert isinstance(group, Group) and src == 0
        while (chunk := packed_tensor.pack_tensors(iterator, post_iter_func, buffer_size_bytes)) is not None:
            server.chunks += 1
            wire = chunk.packed_tensor.clone()  # what the workers receive
            server.received += packed_tensor.unpack_tensor(
                wire, chunk.names, chunk.shapes, chunk.dtypes, chunk.tensor_sizes
            )

    monkeypatch.setattr(nccl_engine, "open_trainer_endpoint", lambda info: Group())
    monkeypatch.setattr(nccl_engine, "packed_nccl_broadcast_producer", broadcast)
    return server


class RecordingClient(FakeClient):
    def __init__(self, server: Worker, **kwargs):
        super().__init__(**kwargs)
        self.server = server

    def init_weight_transfer_engine(self, init_info, context=""):
        self.server.init_payload = init_info
        super().init_weight_transfer_engine(init_info, context)

    def update_weights(self, update_info, context=""):
        self.update_info = update_info
        super().update_weights(update_info, context)


def test_vllms_engine_sends_the_checkpoint_packed_with_the_version(worker, vllm_tiny_path):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(vllm_tiny_path, dtype=torch.float32)
    client = RecordingClient(worker, dtype="bfloat16")
    server = VLLMServerBackend(client, [0], trainer_device=torch.device("cuda"), group_port=52001)
    assert server.nccl.engine_cls is nccl_engine.NCCLTrainerWeightTransferEngine
    server.sync_weights(model)

    payload = worker.init_payload  # what vLLM's engine sends the workers
    assert (payload["master_address"], payload["master_port"]) == ("127.0.0.1", 52001)
    assert (payload["rank_offset"], payload["world_size"], payload["packed"]) == (1, WORKERS + 1, True)
    version = f"{server._run_id}-1"
    assert [entry[0] for entry in client.log] == [
        "wait_until_ready",
        "world_size",
        "init_weight_transfer_engine",
        *SYNC_CALLS,
    ]
    assert ("finish_weight_update", version) in client.log and client.held == version

    expected = {n: t.to(torch.bfloat16) for n, t in model.state_dict().items() if n != "lm_head.weight"}
    info = client.update_info
    assert info["names"] == list(expected) and set(info["dtype_names"]) == {"bfloat16"}
    assert info["shapes"] == [list(t.shape) for t in expected.values()]
    assert [name for name, _ in worker.received] == list(expected)
    for name, tensor in worker.received:
        assert tensor.dtype == torch.bfloat16 and torch.equal(tensor, expected[name]), name
    assert worker.chunks >= 1


def test_a_restart_closes_vllms_group_and_opens_a_new_one(worker, vllm_tiny_path):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(vllm_tiny_path, dtype=torch.float32)
    client = RecordingClient(worker)
    server = VLLMServerBackend(client, [0], trainer_device=torch.device("cuda"), group_port=52002)
    server.sync_weights(model)
    client.held = "default"  # restarted
    server.generate([[1, 2]], 1, _sampling())
    assert worker.destroyed == 1 and [e[0] for e in client.log].count("init_weight_transfer_engine") == 2
    assert len(worker.received) == 2 * len(model.state_dict()) - 2  # the checkpoint twice, lm_head tied


def _sampling():
    from posttrain.generation import SamplingParams

    return SamplingParams(max_tokens=4)


def test_a_cpu_trainer_facing_a_real_nccl_server_is_refused_before_training(vllm_tiny_path, tmp_path):
    """A real server started with `--weight-transfer nccl` (vLLM's CPU build starts it; the group needs GPUs) says
    so at the handshake, and a trainer whose weights are on the CPU stops there, naming the option and the fix."""
    from conftest import ServerProcess
    from transformers import AutoModelForCausalLM

    from posttrain import GRPOConfig
    from posttrain.errors import ConfigError
    from posttrain.generation.vllm_backend import create_vllm_backend
    from posttrain.generation.vllm_client import VLLMClient

    server = ServerProcess(vllm_tiny_path, tmp_path, extra=("--weight-transfer", "nccl"))
    try:
        url = server.ensure()
        client = VLLMClient(url, timeout_s=60)
        assert client.handshake()["weight_transfer"] == "nccl" and client.world_size() == 1
        assert client.engine_weight_version() == "default"  # vLLM's own version before any push: a restart's too
        args = GRPOConfig(
            output_dir=str(tmp_path / "out"), use_vllm=True, vllm_mode="server", vllm_server_base_url=url, use_cpu=True
        )
        model = AutoModelForCausalLM.from_pretrained(vllm_tiny_path)
        with pytest.raises(ConfigError, match=f"{url} was started with `--weight-transfer nccl`.*on cpu.*Restart"):
            create_vllm_backend(model, None, args, [0])
    finally:
        server.stop()


def test_the_gpu_checks_comparison_fails_before_a_sync_and_passes_after(vllm_server, vllm_tiny_path, tmp_path):
    """benchmarks/gpu_vllm_sync.py's check (greedy tokens equal, sampled log-probs within 1e-3) on a real server,
    synced through files here (its NCCL run needs two GPUs): it can fail, and it passes once the weights are in."""
    import sys
    from pathlib import Path

    from transformers import AutoModelForCausalLM

    from posttrain.generation.vllm_client import VLLMClient

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
    import gpu_vllm_sync

    model = AutoModelForCausalLM.from_pretrained(vllm_tiny_path, dtype=torch.float32).eval()
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn(param.shape, generator=generator) * 0.02)
    client = VLLMClient(vllm_server, timeout_s=120)
    files = VLLMServerBackend(client, [], sync_dir=str(tmp_path))
    before = gpu_vllm_sync._compared(model, client)
    files.sync_weights(model, force=True)
    after = gpu_vllm_sync._compared(model, client)
    assert not before["match"] and before["max_logp_diff"] > 0.1
    assert after["match"] and after["tokens_equal"] and after["max_logp_diff"] < 1e-4, after
