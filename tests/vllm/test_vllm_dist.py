"""Two training processes, one vLLM server (issue #16): `accelerate launch` with examples/accelerate_configs/ddp.yaml
(2 CPU processes over gloo) trains GRPO in server mode, each process sending its own prompts to the server while only
the main one pushes the weights, once per round. Seeded sampling makes it exact: the 2 processes x batch b sample the
completions (from the current policy: the sampler's log-probs agree with the trainer's) and compute the losses and
weights of 1 process x batch 2b.

Run with `.venv-vllm/bin/python -m pytest -m "vllm and dist" tests/vllm/test_vllm_dist.py` (one server start and two
short runs; minutes on a loaded 2-core machine)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from _vllm_reference import LOGP_ATOL
from transformers import AutoModelForCausalLM

from posttrain.generation.vllm_client import VLLMClient

pytestmark = [pytest.mark.vllm, pytest.mark.dist]

ROOT = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).with_name("_dist_worker.py")
TOLERANCE = 1e-5


def _run(command: list[str], out: Path, url: str, world_size: int) -> tuple[list[dict], int]:
    """The worker's results per process, and how many weight reloads the server did meanwhile."""
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
    }
    env.update(
        OMP_NUM_THREADS="1",
        PYTHONPATH=str(ROOT),
        TOKENIZERS_PARALLELISM="false",
        HF_HUB_OFFLINE="1",
        HF_DATASETS_OFFLINE="1",
    )
    client = VLLMClient(url, timeout_s=60)
    before = client.weights_version()["reloads"]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=1200)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    results = [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(world_size)]
    return results, client.weights_version()["reloads"] - before


def test_two_processes_share_one_server_and_match_one_process_with_twice_the_batch(
    vllm_server, vllm_tiny_path, tmp_path
):
    single, single_reloads = _run(
        [sys.executable, str(WORKER), str(tmp_path / "one"), "16", vllm_tiny_path, vllm_server],
        tmp_path / "one",
        vllm_server,
        1,
    )
    config = ROOT / "examples" / "accelerate_configs" / "ddp.yaml"
    ranks, reloads = _run(
        [
            sys.executable,
            "-m",
            "accelerate.commands.launch",
            "--config_file",
            str(config),
            "--main_process_port",
            "0",
            str(WORKER),
            str(tmp_path / "two"),
            "8",
            vllm_tiny_path,
            vllm_server,
        ],
        tmp_path / "two",
        vllm_server,
        2,
    )
    (reference,) = single
    assert reference["world_size"] == 1 and [r["world_size"] for r in ranks] == [2, 2]
    # one push per round (3 rounds), by the main process only; every process counted them and shares its directory
    assert single_reloads == reloads == 3
    assert [r["pushes"] for r in ranks] == [3, 3] and ranks[0]["sync_dir"] == ranks[1]["sync_dir"]
    # each process generated its own half of every round: together, the single process's completions
    for index, expected in enumerate(reference["rounds"]):
        together = ranks[0]["rounds"][index] + ranks[1]["rounds"][index]
        assert len(ranks[0]["rounds"][index]) == len(ranks[1]["rounds"][index]) == 8
        assert [(p, ids) for p, ids, _ in together] == [(p, ids) for p, ids, _ in expected], f"round {index + 1}"
        for (_, _, got), (_, _, want) in zip(together, expected):
            torch.testing.assert_close(torch.tensor(got), torch.tensor(want), atol=LOGP_ATOL, rtol=0)
    # sampled from the current policy in both runs (logged: the mean over processes of each one's largest gap)
    for run in (reference, *ranks):
        diffs = [entry["sampler/logp_diff_max"] for entry in run["logs"]]
        assert len(diffs) == 3 and max(diffs) < LOGP_ATOL
    start = AutoModelForCausalLM.from_pretrained(vllm_tiny_path, dtype=torch.float32).state_dict()
    assert max((reference["params"][n] - start[n]).abs().max().item() for n in reference["params"]) > 1e-3
    for rank in ranks:
        assert rank["loss"] == pytest.approx(reference["loss"], abs=TOLERANCE)
        for name, value in reference["params"].items():
            torch.testing.assert_close(rank["params"][name], value, atol=TOLERANCE, rtol=0, msg=name)
