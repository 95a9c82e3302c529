"""Server mode's NCCL weight sync (posttrain/generation/vllm_nccl_sync.py), on CPU: vLLM's trainer-side engine and
the HTTP client are fakes that record what they are asked, so the order of the calls, the versions and the tensors
sent (PEFT merged, tied once, FSDP2 gathered, in the server's dtype) are checked against references built here.
The real NCCL transfer needs a GPU: benchmarks/gpu_check.py runs it (docs/gpu.md)."""

from __future__ import annotations

import threading
import time

import pytest
import torch
from _vllm_fakes import SYNC_CALLS, URL, WORKERS, FakeClient, FakeEngine, fake_engine_classes
from transformers import AutoModelForCausalLM

from posttrain.errors import ConfigError
from posttrain.generation import vllm_nccl_sync
from posttrain.generation.vllm_backend import VLLMServerBackend
from posttrain.generation.vllm_client import VLLMServerError


@pytest.fixture
def fake_vllm(monkeypatch):
    FakeEngine.log, FakeEngine.sent, FakeEngine.block = [], [], None
    monkeypatch.setattr(vllm_nccl_sync, "_vllm_engine", fake_engine_classes)
    return FakeEngine


def backend(client, device="cuda", port=51999):
    return VLLMServerBackend(client, [0], trainer_device=torch.device(device), group_port=port)


def calls(client):
    return [entry[0] if entry[0] != "finish_weight_update" else entry for entry in client.log]


def expected_state(model, dtype=None):
    """The checkpoint's tensors by hand: the state dict without the tied lm_head, cast to the server's dtype."""
    state = {n: t for n, t in model.state_dict().items() if n != "lm_head.weight"}
    return {n: (t.to(dtype) if dtype is not None else t).clone() for n, t in state.items()}


def assert_sent(pairs, expected):
    assert [name for name, _ in pairs] == list(expected)
    for name, tensor in pairs:
        assert tensor.dtype == expected[name].dtype and torch.equal(tensor, expected[name]), name


def sync_calls(version):
    return [("finish_weight_update", version) if c == "finish_weight_update" else c for c in SYNC_CALLS]


def test_calls_versions_and_tensors_in_order(fake_vllm, tiny_model_path):
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path)
    client = FakeClient()
    server = backend(client)
    assert server.nccl is not None and server.nccl.master_address == "127.0.0.1"
    server.sync_weights(model)
    first = expected_state(model)
    with torch.no_grad():
        model.model.embed_tokens.weight.add_(1.0)  # the tied lm_head moves with it
    server.sync_weights(model)
    run = server._run_id
    assert calls(client) == [
        "wait_until_ready",
        "world_size",
        "init_weight_transfer_engine",
        *sync_calls(f"{run}-1"),
        *sync_calls(f"{run}-2"),
    ]
    assert ("init_weight_transfer_engine", 51999, WORKERS + 1) in client.log  # vllm_group_port, workers + trainer
    assert fake_vllm.log[0] == (
        "trainer_init",
        dict(master_address="127.0.0.1", master_port=51999, world_size=WORKERS + 1, rank=0),
    )
    assert_sent(fake_vllm.sent[0], first)
    assert_sent(fake_vllm.sent[1], expected_state(model))
    assert not torch.equal(fake_vllm.sent[0][0][1], fake_vllm.sent[1][0][1])
    names = [entry[1] for entry in client.log if entry[0] == "update_weights"]
    assert names[0] == tuple(first)  # the server is told exactly what comes


def test_weights_go_in_the_servers_dtype(fake_vllm, tiny_model_path):
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path)
    backend(FakeClient(dtype="bfloat16")).sync_weights(model)
    assert_sent(fake_vllm.sent[0], expected_state(model, torch.bfloat16))


def test_peft_sends_the_merged_weights_and_keeps_the_trainers(fake_vllm, tiny_model_path):
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(
        AutoModelForCausalLM.from_pretrained(tiny_model_path),
        LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False),
    )
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    backend(FakeClient()).sync_weights(model)
    sent = dict(fake_vllm.sent[0])
    assert "lm_head.weight" not in sent and not any("lora" in n or "base_layer" in n for n in sent)
    merged = 0
    for name, tensor in sent.items():
        prefix = "base_model.model." + name.removesuffix(".weight")
        if name.endswith(("q_proj.weight", "v_proj.weight")):  # W + (alpha / r) B A, in float64
            a = before[f"{prefix}.lora_A.default.weight"].double()
            b = before[f"{prefix}.lora_B.default.weight"].double()
            expected = before[f"{prefix}.base_layer.weight"].double() + 2.0 * b @ a
            torch.testing.assert_close(tensor.double(), expected, atol=1e-6, rtol=0)
            merged += 1
        else:
            assert torch.equal(tensor, before["base_model.model." + name]), name
    assert merged == 2 * model.config.num_hidden_layers
    for name, parameter in model.named_parameters():
        assert torch.equal(parameter, before[name]), name  # unmerged bit for bit


def test_fsdp2_shards_are_gathered_before_the_send(fake_vllm, tiny_model_path, free_tcp_port):
    """FSDP2 on one gloo process: the parameters are DTensors (state_dict too), gathered with `full_tensor`; what is
    sent equals the unsharded model's checkpoint, the tied weight once."""
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    reference = AutoModelForCausalLM.from_pretrained(tiny_model_path)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_tcp_port}", rank=0, world_size=1)
    try:
        for layer in model.model.layers:
            fully_shard(layer)
        fully_shard(model)
        assert all(hasattr(p, "full_tensor") for p in model.parameters())
        backend(FakeClient()).sync_weights(model)
    finally:
        dist.destroy_process_group()
    assert_sent(fake_vllm.sent[0], expected_state(reference))


def test_a_failed_transfer_names_the_server_and_the_version(fake_vllm, tiny_model_path):
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path)
    client = FakeClient(fail_on="update_weights")
    server = backend(client)
    with pytest.raises(VLLMServerError, match=f"version {server._run_id}-1 .*{URL}.*HTTP 500: boom"):
        server.sync_weights(model)
    assert ("shutdown",) in fake_vllm.log and server.nccl.engine is None  # the group is dropped, opened anew next
    assert calls(client)[-1] == "resume"  # generation is not left paused


def test_a_taken_group_port_is_named(fake_vllm, tiny_model_path, monkeypatch):
    def taken(info, *, client, source):
        raise RuntimeError("The server socket has failed to listen on any local network address (port 51999)")

    monkeypatch.setattr(FakeEngine, "trainer_init", taken)
    server = backend(FakeClient())
    with pytest.raises(
        VLLMServerError, match=f"version {server._run_id}-1 .*{URL} failed: .*127.0.0.1:51999.*vllm_group_port"
    ):
        server.sync_weights(AutoModelForCausalLM.from_pretrained(tiny_model_path))


def test_a_transfer_that_hangs_times_out_naming_the_server_and_the_version(fake_vllm, tiny_model_path):
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path)
    client = FakeClient()
    client.timeout_s = 1.0
    server = backend(client)
    fake_vllm.block = threading.Event()
    started = time.monotonic()
    try:
        with pytest.raises(VLLMServerError, match=f"version {server._run_id}-1 .*{URL}: no answer within 1 s"):
            server.sync_weights(model)
    finally:
        fake_vllm.block.set()
    assert time.monotonic() - started < 15


def test_a_restarted_server_gets_a_new_group_and_the_last_weights(fake_vllm, tiny_model_path):
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path)
    client = FakeClient()
    server = backend(client)
    server.sync_weights(model)
    pushed = expected_state(model)
    with torch.no_grad():  # a training step after the sync: not what the server held
        model.model.norm.weight.add_(0.5)
    client.held, client.log = "default", []  # restarted between two requests: its start-up weights
    server.generate([[1, 2]], 1, _sampling())
    version = f"{server._run_id}-1"
    assert calls(client) == [
        "engine_weight_version",
        "world_size",
        "init_weight_transfer_engine",
        *sync_calls(version),
        "generate",
    ]
    assert ("shutdown",) in fake_vllm.log and server.reconnects == 1
    assert_sent(fake_vllm.sent[1], pushed)  # the weights of the last sync, not the trainer's current ones


def test_a_server_away_during_a_push_is_waited_for_and_the_push_retried(fake_vllm, tiny_model_path):
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path)
    client = FakeClient()
    server = backend(client)
    client.down = 1  # the first call of the push (world_size, before the group opens) finds nobody
    server.sync_weights(model)
    assert calls(client) == [
        "wait_until_ready",
        "wait_until_ready",  # waiting for it to come back
        "world_size",
        "init_weight_transfer_engine",
        *sync_calls(f"{server._run_id}-1"),
    ]
    assert server.reconnects == 1
    assert_sent(fake_vllm.sent[0], expected_state(model))


def test_a_cpu_trainer_is_refused_before_training_and_files_stay_the_default(fake_vllm):
    with pytest.raises(ConfigError, match=f"{URL} was started with `--weight-transfer nccl`.*on cpu.*without"):
        backend(FakeClient(), device="cpu")
    assert backend(FakeClient(weight_transfer=None), device="cuda").nccl is None  # a file-sync server
    assert backend(FakeClient(weight_transfer=None), device="cpu").nccl is None


def test_the_trainer_address_the_server_reaches():
    assert vllm_nccl_sync.trainer_address("http://localhost:8000") == "127.0.0.1"
    assert vllm_nccl_sync.trainer_address("http://127.0.0.5:8000") == "127.0.0.1"


def _sampling():
    from posttrain.generation import SamplingParams

    return SamplingParams(max_tokens=4)


def test_vllm_group_port_reaches_the_sync_and_is_said_unused_with_a_file_server(
    fake_vllm, tiny_model_path, tmp_path, monkeypatch, caplog
):
    from posttrain import GRPOConfig
    from posttrain.generation import vllm_backend

    model = AutoModelForCausalLM.from_pretrained(tiny_model_path)
    settings = dict(use_vllm=True, vllm_mode="server", vllm_server_base_url=URL, vllm_group_port=52345)
    args = GRPOConfig(output_dir=str(tmp_path), **settings)
    monkeypatch.setattr(vllm_backend, "VLLMClient", lambda *a, **k: FakeClient(weight_transfer=None))
    with caplog.at_level("WARNING"):
        assert vllm_backend.create_vllm_backend(model, None, args, [0]).nccl is None
    assert f"vllm_group_port=52345 is unused: the vLLM server at {URL} gets the weights through files" in caplog.text
    monkeypatch.setattr(vllm_backend, "VLLMClient", lambda *a, **k: FakeClient())
    with pytest.raises(ConfigError, match="--weight-transfer nccl"):  # the trainer's model is on the CPU
        vllm_backend.create_vllm_backend(model, None, args, [0])
    model.to("meta")  # a stand-in for a GPU trainer's device: what create_vllm_backend reads
    monkeypatch.setattr(vllm_nccl_sync, "check_nccl_trainer", lambda info, device, url: device.type == "meta")
    monkeypatch.setattr(vllm_backend, "check_nccl_trainer", vllm_nccl_sync.check_nccl_trainer)
    assert vllm_backend.create_vllm_backend(model, None, args, [0]).nccl.group_port == 52345
