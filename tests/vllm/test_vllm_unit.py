"""The parts of the vLLM integration that need no vLLM: the weights sent (PEFT merged, names, tied
embeddings), when syncs happen, the log-prob mismatch metrics, the server command, and the client's errors
for dead, slow, outdated or misconfigured servers (a small HTTP server on 127.0.0.1 plays the last ones).
These run in both environments."""

from __future__ import annotations

import json
import math
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import torch
from transformers import AutoModelForCausalLM

from posttrain.generation import Completion, SamplingParams
from posttrain.generation.vllm_backend import (
    _SyncSchedule,
    policy_weights,
    sampler_logps_tensor,
    sampler_mismatch_metrics,
    save_weights,
)
from posttrain.generation.vllm_client import VLLMClient, VLLMServerError
from posttrain.generation.vllm_worker import PROTOCOL_VERSION

SAMPLING = SamplingParams(max_tokens=4)


# -- the weights sent ------------------------------------------------------------------------------------------
def test_tied_weights_are_sent_once_under_the_checkpoint_names(tiny_model_path):
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path)
    with policy_weights(model) as weights:
        names = [name for name, _ in weights]
        assert "lm_head.weight" not in names  # the same tensor as the embedding
        state = model.state_dict()
        assert names == [n for n in state if n != "lm_head.weight"]
        for name, tensor in weights:
            assert torch.equal(tensor, state[name])


def test_peft_weights_are_merged_for_the_sync_and_the_trainer_keeps_its_own(tiny_model_path):
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(
        AutoModelForCausalLM.from_pretrained(tiny_model_path),
        LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False),
    )
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    base_names = list(AutoModelForCausalLM.from_pretrained(tiny_model_path).state_dict())
    with policy_weights(model) as weights:
        sent = {name: tensor.clone() for name, tensor in weights}
    assert list(sent) == [n for n in base_names if n != "lm_head.weight"]
    for name, tensor in sent.items():
        if name.endswith(("q_proj.weight", "v_proj.weight")):  # W + (alpha / r) * B @ A, in float64
            prefix = "base_model.model." + name.removesuffix(".weight")
            a = before[f"{prefix}.lora_A.default.weight"].double()
            b = before[f"{prefix}.lora_B.default.weight"].double()
            expected = before[f"{prefix}.base_layer.weight"].double() + 2.0 * b @ a
            torch.testing.assert_close(tensor.double(), expected, atol=1e-6, rtol=0)
            assert (b @ a).abs().max() > 1e-3  # the adapter does change the weight
        else:
            assert torch.equal(tensor, before["base_model.model." + name])
    for name, parameter in model.named_parameters():  # bit-identical, not just close
        assert torch.equal(parameter, before[name]), name
    assert not any(getattr(m, "merged", False) for m in model.modules())


def test_a_ppo_policy_and_value_model_sends_only_the_policy(tiny_model_path):
    from posttrain.models.loading import load_sequence_classifier
    from posttrain.trainers.ppo import PolicyAndValueModel

    policy = AutoModelForCausalLM.from_pretrained(tiny_model_path)
    with policy_weights(PolicyAndValueModel(policy, load_sequence_classifier(tiny_model_path))) as weights:
        assert [name for name, _ in weights] == [n for n in policy.state_dict() if n != "lm_head.weight"]


def test_the_file_sync_of_an_fsdp2_trainer_writes_the_whole_checkpoint(tiny_model_path, tmp_path):
    """FSDP2 on one gloo process: the parameters (and the state dict) are DTensors; the sync gathers them and the
    file holds the unsharded model's checkpoint, the tied weight once."""
    import socket

    import torch.distributed as dist
    from _vllm_fakes import FakeClient
    from safetensors.torch import load_file
    from torch.distributed.fsdp import fully_shard

    from posttrain.generation.vllm_backend import VLLMServerBackend

    reference = AutoModelForCausalLM.from_pretrained(tiny_model_path)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
        for layer in model.model.layers:
            fully_shard(layer)
        fully_shard(model)
        client = FakeClient(weight_transfer=None)
        VLLMServerBackend(client, [0], sync_dir=tmp_path, trainer_device=torch.device("cpu")).sync_weights(model)
    finally:
        dist.destroy_process_group()
    assert [entry[0] for entry in client.log][-1] == "reload_weights"
    saved = load_file(str(tmp_path / "model.safetensors"))
    expected = {n: t for n, t in reference.state_dict().items() if n != "lm_head.weight"}
    assert set(saved) == set(expected)
    for name, tensor in expected.items():
        assert torch.equal(saved[name], tensor), name


def test_save_weights_writes_one_file_cast_to_the_server_dtype(tmp_path):
    from safetensors.torch import load_file

    weights = [("a.weight", torch.randn(3, 2)), ("steps", torch.tensor([5, 6]))]
    path = save_weights(weights, tmp_path, torch.bfloat16)
    loaded = load_file(path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.safetensors"]
    assert loaded["a.weight"].dtype == torch.bfloat16 and loaded["steps"].dtype == torch.int64
    assert torch.equal(loaded["a.weight"], weights[0][1].to(torch.bfloat16))
    assert torch.equal(loaded["steps"], weights[1][1])


# -- when weights are synced -----------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "sync_steps, steps_per_round, expected",
    [
        (1, 1, [True, True, True, True]),
        (2, 1, [True, False, True, False]),
        (3, 2, [True, False, True, False, True]),  # rounds at steps 0, 2, 4, 6, 8: synced at 0, 4, 8
    ],
)
def test_sync_schedule(sync_steps, steps_per_round, expected):
    schedule = _SyncSchedule(sync_steps, steps_per_round)
    assert [schedule.due() for _ in expected] == expected


# -- sampler log-probs -------------------------------------------------------------------------------------------
def test_sampler_logps_are_padded_and_missing_ones_give_none():
    completions = [Completion(0, [1, 2], [-0.5, -1.0], True), Completion(0, [3], [-2.0], False)]
    assert torch.equal(sampler_logps_tensor(completions, 3), torch.tensor([[-0.5, -1.0, 0.0], [-2.0, 0.0, 0.0]]))
    assert sampler_logps_tensor([Completion(0, [1], None, False)], 1) is None


def test_sampler_mismatch_metrics_by_hand():
    trainer = torch.tensor([[-1.0, -2.0, -3.0], [-0.5, -9.0, -9.0]])
    sampler = torch.tensor([[-1.1, -1.8, 5.0], [-0.5, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    metrics = sampler_mismatch_metrics(trainer, sampler, mask)
    diffs = [0.1, -0.2, 0.0]  # trainer - sampler on the three masked-in tokens
    assert metrics["sampler/logp_diff_mean"].item() == pytest.approx(0.1, abs=1e-6)
    assert metrics["sampler/logp_diff_max"].item() == pytest.approx(0.2, abs=1e-6)
    expected_ratio = sum(math.exp(d) for d in diffs) / 3
    assert metrics["sampler/ratio_mean"].item() == pytest.approx(expected_ratio, abs=1e-6)


# -- the server command -------------------------------------------------------------------------------------------
def test_serve_command_enables_what_training_needs(tmp_path):
    from posttrain.cli.vllm_serve import build_server_command

    command, env = build_server_command(
        [str(tmp_path), "--port", "9001", "--kv-cache-gb", "0.5", "--", "--max-num-seqs", "16"], device="cpu"
    )
    assert command[1:3] == ["-m", "vllm.entrypoints.openai.api_server"]
    flags = {word: command[i + 1] for i, word in enumerate(command[:-1]) if word.startswith("--")}
    assert flags["--model"] == str(tmp_path) and flags["--port"] == "9001" and flags["--host"] == "0.0.0.0"
    assert flags["--worker-extension-cls"] == "posttrain.generation.vllm_worker.PosttrainWorkerExtension"
    assert flags["--logprobs-mode"] == "processed_logprobs" and "--generation-config" not in command
    assert flags["--kv-cache-memory-bytes"] == str(2**29)
    assert "--enforce-eager" in command and command[-2:] == ["--max-num-seqs", "16"]
    assert env["VLLM_SERVER_DEV_MODE"] == "1" and "VLLM_CACHE_ROOT" in env


# -- client errors ---------------------------------------------------------------------------------------------------
def test_unreachable_server_fails_fast_naming_the_url_and_the_step(unused_port):
    url = f"http://127.0.0.1:{unused_port}"  # nothing listens there
    client = VLLMClient(url, timeout_s=5)
    client.model_name = "m"  # skip the handshake: the first request is the generation
    started = time.monotonic()
    with pytest.raises(VLLMServerError) as error:
        client.generate([[1, 2]], 2, SAMPLING, None, [0], context="generation round 3, at optimizer step 2")
    assert time.monotonic() - started < 5
    message = str(error.value)
    assert url in message and "optimizer step 2" in message and "vllm-serve" in message
    with pytest.raises(VLLMServerError, match=f"{url} was not ready within 2 s"):
        client.wait_until_ready(timeout_s=2)


class _FakeServer:
    """An HTTP server on 127.0.0.1 answering the client's handshake with chosen answers."""

    def __init__(self, version="0.32.0", protocol=PROTOCOL_VERSION, rpc_status=200, delay_s=0.0):
        answers = {
            "/health": (200, {}),
            "/version": (200, {"version": version}),
            "/v1/models": (200, {"data": [{"id": "m"}]}),
            "/collective_rpc": (
                rpc_status,
                {"results": [{"protocol": protocol, "max_model_len": 64, "dtype": "float32"}]}
                if rpc_status == 200
                else {"detail": "Not Found"},
            ),
            "/v1/completions": (500, {"error": {"message": "EngineCore encountered an issue"}}),
        }

        class Handler(BaseHTTPRequestHandler):
            def _answer(self):
                time.sleep(delay_s)
                status, body = answers.get(self.path, (404, {"detail": "Not Found"}))
                payload = json.dumps(body).encode()
                try:
                    self.send_response(status)
                    self.send_header("Content-Length", str(len(payload)))
                    self.end_headers()
                    self.wfile.write(payload)
                except (BrokenPipeError, ConnectionResetError):  # the client gave up waiting, as tested
                    pass

            def do_GET(self):
                self._answer()

            def do_POST(self):
                self.rfile.read(int(self.headers.get("Content-Length", 0)))
                self._answer()

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads, self.server.block_on_close = True, False
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def __enter__(self):
        return self.url

    def __exit__(self, *exc):
        self.server.shutdown()
        self.server.server_close()


@pytest.mark.parametrize(
    "server, message",
    [
        (dict(version="0.11.2"), "needs vLLM >= 0.32"),
        (dict(protocol=PROTOCOL_VERSION + 1), "Version mismatch"),
        (dict(rpc_status=404), "VLLM_SERVER_DEV_MODE=1"),
        (dict(rpc_status=500), "worker-extension-cls"),
    ],
)
def test_handshake_names_what_to_fix(server, message):
    with _FakeServer(**server) as url:
        with pytest.raises(VLLMServerError, match=message) as error:
            VLLMClient(url, timeout_s=10).wait_until_ready(timeout_s=10)
        assert url in str(error.value)


def test_server_errors_and_slow_answers_are_reported_not_waited_for():
    with _FakeServer() as url:
        client = VLLMClient(url, timeout_s=10)
        assert client.wait_until_ready(timeout_s=10)["model"] == "m"
        with pytest.raises(VLLMServerError, match="HTTP 500: EngineCore encountered an issue"):
            client.generate([[1]], 1, SAMPLING, [7], [0])
    with _FakeServer(delay_s=3.0) as url:
        started = time.monotonic()
        with pytest.raises(VLLMServerError, match="did not answer within 1 s"):
            VLLMClient(url, timeout_s=1).generate([[1]], 1, SAMPLING, None, [0])
        assert time.monotonic() - started < 3


def test_generation_kwargs_and_the_regex_go_into_the_request():
    client = VLLMClient("http://127.0.0.1:1", timeout_s=1)
    client.model_name = "m"
    sent = []

    def request(method, path, body, **kwargs):
        sent.append(body)
        return {"choices": [{"index": 0, "token_ids": [5, 0], "logprobs": {"token_logprobs": [-0.5, -0.1]}}]}

    client.request = request
    sampling = SamplingParams(max_tokens=4, extra={"presence_penalty": 0.5}, regex="[ab]+")
    completions = client.generate([[1, 2]], 1, sampling, [3], [0])
    assert sent[0]["presence_penalty"] == 0.5 and sent[0]["structured_outputs"] == {"regex": "[ab]+"}
    assert sent[0]["seed"] == 3 and completions[0].token_ids == [5, 0] and completions[0].finished_with_eos
    client.generate([[1, 2]], 1, SAMPLING, None, [0])
    assert "structured_outputs" not in sent[1] and "presence_penalty" not in sent[1]
