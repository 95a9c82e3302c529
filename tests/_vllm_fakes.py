"""Stand-ins for the NCCL weight sync's two partners (tests/generation, tests/vllm, tests/dist): posttrain's
VLLMClient as the server backend uses it (it records every call, answers the handshake as a server started with
`--weight-transfer nccl`, and can be made to fail one call or to be away for a few), and vLLM's trainer-side
NCCL engine (the same calls on its client and source, the broadcast replaced by a record of the tensors)."""

from __future__ import annotations

import threading
from dataclasses import asdict, dataclass

import torch

from posttrain.generation.vllm_client import VLLMServerError, VLLMServerUnreachable

URL = "http://127.0.0.1:8123"
# the calls of one NCCL sync, in order (vllm_nccl_sync.py)
SYNC_CALLS = ["pause", "start_weight_update", "update_weights", "finish_weight_update", "reset_prefix_cache", "resume"]
WORKERS = 2  # the fake server's tensor-parallel workers: the group is them plus the trainer


class FakeClient:
    """posttrain's VLLMClient as the backend and the NCCL sync use it, recording every call."""

    def __init__(self, weight_transfer="nccl", dtype="float32", fail_on=None):
        self.base_url, self.timeout_s, self.connect_timeout_s = URL, 5.0, 5.0
        self.weight_transfer, self.dtype, self.fail_on = weight_transfer, dtype, fail_on
        self.log, self.held, self.down = [], "default", 0

    def _record(self, name, *args):
        if self.down:  # the server is away for this many calls
            self.down -= 1
            raise VLLMServerUnreachable(f"{name} failed: could not reach the vLLM server at {URL}")
        self.log.append((name, *args))
        if name == self.fail_on:
            raise VLLMServerError(f"{name} failed: the vLLM server at {URL} answered HTTP 500: boom")

    def wait_until_ready(self, timeout_s=None):
        self.log.append(("wait_until_ready",))
        info = dict(model="m", vocab_size=None, max_model_len=64, dtype=self.dtype)
        return {**info, "weight_transfer": self.weight_transfer}

    def world_size(self, context=""):
        self._record("world_size")
        return WORKERS

    def init_weight_transfer_engine(self, init_info, context=""):
        self._record("init_weight_transfer_engine", init_info["master_port"], init_info["world_size"])

    def start_weight_update(self, context=""):
        self._record("start_weight_update")

    def update_weights(self, update_info, context=""):
        self._record("update_weights", tuple(update_info["names"]))

    def finish_weight_update(self, weight_version=None, context=""):
        self._record("finish_weight_update", weight_version)
        self.held = weight_version

    def pause(self, context=""):
        self._record("pause")

    def resume(self, context=""):
        self._record("resume")

    def reset_prefix_cache(self, context=""):
        self._record("reset_prefix_cache")

    def reload_weights(self, directory, context="", version=None):  # the file sync
        self._record("reload_weights", directory, version)
        self.held = version

    def weights_version(self, context=""):
        self._record("weights_version")
        return {"version": self.held}

    def engine_weight_version(self, context=""):
        self._record("engine_weight_version")
        return self.held

    def generate(self, prompt_ids, n, sampling, seeds, stop, context=""):
        self._record("generate")
        return []


@dataclass
class FakeInitInfo:  # vLLM's NCCLTrainerInitInfo's fields
    master_address: str
    master_port: int
    world_size: int
    rank: int


@dataclass
class FakeMeta:  # vLLM's ParamMeta
    name: str
    dtype: torch.dtype
    shape: tuple


class FakeEngine:
    """What vLLM's NCCLTrainerWeightTransferEngine does with its client and source, the broadcast replaced by a
    record of the tensors (cloned as they would be on the wire)."""

    log: list
    sent: list
    block: threading.Event | None = None

    def __init__(self, client, source):
        self.client, self.source = client, source

    @classmethod
    def trainer_init(cls, info, *, client, source):
        cls.log.append(("trainer_init", asdict(info)))
        client.init_weight_transfer_engine({**asdict(info), "rank_offset": 1})
        return cls(client, source)

    def send_weights(self):
        meta = self.source.metadata()
        self.client.start_weight_update()
        self.client.update_weights({"names": [m.name for m in meta], "dtype_names": [str(m.dtype) for m in meta]})
        if FakeEngine.block is not None:
            FakeEngine.block.wait()  # a server that never joins the broadcast
        pairs = [(name, tensor.clone()) for name, tensor in self.source]
        assert [(n, t.dtype, tuple(t.shape)) for n, t in pairs] == [(m.name, m.dtype, m.shape) for m in meta]
        FakeEngine.sent.append(pairs)
        self.client.finish_weight_update()

    def shutdown(self):
        FakeEngine.log.append(("shutdown",))


def fake_engine_classes():
    """What `vllm_nccl_sync._vllm_engine` returns, with the fakes."""
    return FakeEngine, FakeInitInfo, FakeMeta
