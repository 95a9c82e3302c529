"""The rollout producers give, bit for bit, the losses and parameters recorded before they became one interface
(tests/fixtures/producer_golden.json): the synchronous run, the thread at k = 0, 1 and 2, and the generation process at
k = 0 (in-flight updates on: nothing trains while a k = 0 round is sampled, so the run is deterministic) and k = 1
without in-flight updates. In-flight updates at k >= 1 take weights at timing-dependent decode steps, so they have
no recorded numbers; test_async_process.py checks them against their own saved rounds.

To record again (only when a change is meant to alter these numbers, and say so in the commit):
    source scripts/env.sh
    PYTHONPATH=$PWD OMP_NUM_THREADS=1 .venv/bin/python tests/online/test_producers_golden.py --record
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import TrainerCallback

GOLDEN = Path(__file__).parents[1] / "fixtures" / "producer_golden.json"
RUNS = {
    "sync": {},
    "thread_k0": dict(async_generation_rounds=0),
    "thread_k1": dict(async_generation_rounds=1),
    "thread_k2_sync2": dict(async_generation_rounds=2, vllm_sync_steps=2),
    "process_k0_inflight": dict(async_generation_rounds=0, async_generation_process=True),
    "process_k1": dict(async_generation_rounds=1, async_generation_process=True, async_inflight_weight_updates=False),
}


class ParameterDigests(TrainerCallback):
    """A sha256 of the policy's parameters (in name order, as bytes) after every optimizer step."""

    def __init__(self):
        self.digests: dict[int, str] = {}

    def on_step_end(self, args, state, control, model=None, **kwargs):
        digest = hashlib.sha256()
        for name, value in sorted(model.named_parameters()):
            digest.update(name.encode())
            digest.update(value.detach().contiguous().numpy().tobytes())
        self.digests[state.global_step] = digest.hexdigest()


def same_threads_split():
    """Both processes on every CPU with this process's thread count: the kernels, and so the numbers, of a
    synchronous run."""
    from posttrain.runtime.cores import CoreSplit

    cpus = tuple(sorted(os.sched_getaffinity(0)))
    return CoreSplit(cpus, cpus, torch.get_num_threads(), torch.get_num_threads())


def run(name: str, model_path: str, output_dir: Path, monkeypatch) -> dict:
    from test_engine import stopping_model
    from test_producers_thread import grpo, losses

    from posttrain.online.producers import process

    monkeypatch.setattr(process, "generation_core_split", lambda *args: same_threads_split())
    digests = ParameterDigests()
    trainer = grpo(stopping_model(model_path), output_dir / name, callbacks=[digests], **RUNS[name])
    trainer.train()
    return {"loss": {str(step): loss for step, loss in losses(trainer).items()}, "params": digests.digests}


def recorded() -> dict:
    return json.loads(GOLDEN.read_text())


@pytest.mark.parametrize("name", sorted(RUNS))
def test_producers_give_the_recorded_losses_and_parameters(name, tmp_path, tiny_model_path, monkeypatch):
    golden = recorded()
    if golden["torch"] != torch.__version__:
        pytest.skip(f"recorded with torch {golden['torch']}, this is {torch.__version__} (other kernels)")
    got = run(name, tiny_model_path, tmp_path, monkeypatch)
    want = golden["runs"][name]
    assert got["loss"] == want["loss"]
    assert {str(step): digest for step, digest in got["params"].items()} == want["params"]


def record() -> None:
    """Runs every case and writes GOLDEN (with how it was produced)."""
    import tempfile

    sys.path[:0] = [str(Path(__file__).parent), str(Path(__file__).parents[1])]
    from posttrain.models.tiny import save_tiny_model

    class Patch:
        def setattr(self, target, name, value):
            setattr(target, name, value)

    with tempfile.TemporaryDirectory() as tmp:
        model_path = save_tiny_model(Path(tmp) / "model")
        runs = {name: run(name, model_path, Path(tmp), Patch()) for name in RUNS}
    commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True).stdout.strip()
    out = {
        "how": "PYTHONPATH=$PWD OMP_NUM_THREADS=1 python tests/online/test_producers_golden.py --record",
        "commit": commit,
        "torch": torch.__version__,
        "machine": platform.machine(),
        "threads": torch.get_num_threads(),
        "runs": {
            name: {"loss": r["loss"], "params": {str(k): v for k, v in r["params"].items()}} for name, r in runs.items()
        },
    }
    GOLDEN.write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__" and sys.argv[1:] == ["--record"]:
    record()
