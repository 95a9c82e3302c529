"""rollout_backend="ray" under several training processes (posttrain/online/producers/ray_ranks.py): two DDP or
FSDP2 processes (`accelerate launch` of examples/accelerate_configs/<engine>.yaml, gloo on CPU) whose rank 0 starts
a loopback Ray with 2 rollout actors and routes every rank's prompts. At k = 0 each rank trains on exactly the
completions the synchronous producer generates on it (bit for bit), so the losses and final parameters are the
synchronous run's: bit for bit under DDP; under FSDP2 to 1e-6, since the sharded trainer's log-probs and the actor's
forward on the gathered weights round apart (6e-8 in the loss) and the importance correction carries that in. SGD
in float32 (under bf16 autocast the trainer's log-probs differ from the actor's float32 ones by about 3e-4). With
k = 1 the run finishes with every round within max_staleness=1. SIGTERM to both ranks with 2 rounds ahead: the
run checkpoints (rank 0 keeps every rank's rounds ahead) and exits 0, and resumed it ends as the run that did not
stop, bit for bit.

Run with `pytest -m "dist and ray" tests/dist/test_ray_ranks.py` (about 6.5 minutes on 2 loaded cores, 2.3 of them the
SIGTERM test)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from test_equivalence import ROOT, _env

from posttrain.training.checkpoints import CHECKPOINT_MARKER, TRAINER_STATE_FILE

pytestmark = [pytest.mark.dist, pytest.mark.ray]
pytest.importorskip("ray")  # the `ray` extra (CI runs this file with the dist tests)
WORKER = Path(__file__).with_name("ray_worker.py")


def _run(out: Path, model: str, *mode: str, engine: str = "ddp") -> str:
    """One `accelerate launch` of ray_worker.py; checks that it exited 0 and returns its output."""
    config = ROOT / "examples" / "accelerate_configs" / f"{engine}.yaml"
    command = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(config),
               "--main_process_port", "0", str(WORKER), str(out), model, "8", *mode]
    env = {**_env(), "RAY_USAGE_STATS_ENABLED": "0", "RAY_ENABLE_UV_RUN_RUNTIME_ENV": "0"}
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600, cwd=WORKER.parent)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done.stdout + done.stderr


def _launch(out: Path, model: str, *mode: str, engine: str = "ddp") -> list[dict]:
    _run(out, model, *mode, engine=engine)
    ranks = [torch.load(out / f"rank{rank}.pt", weights_only=False) for rank in (0, 1)]
    for rank in ranks:
        assert "error" not in rank, rank["error"]
        assert rank["world_size"] == 2
    return ranks


@pytest.mark.parametrize("engine", ["ddp", "fsdp2"])
def test_two_ranks_with_two_actors_are_the_synchronous_run(engine, tmp_path, tiny_model_path):
    sync = _launch(tmp_path / "sync", tiny_model_path, "sync", engine=engine)
    actors = _launch(tmp_path / "ray", tiny_model_path, "ray", "0", engine=engine)
    assert [r["producer"] for r in sync] == ["SynchronousProducer"] * 2
    assert [r["producer"] for r in actors] == ["RankRouter"] * 2
    assert sync[0]["moved"] > 1e-2  # the steps move the weights, or equal weights would prove nothing
    for one, other in zip(sync, actors):
        assert len(one["completions"]) == len(other["completions"]) == 3
        for mine, theirs in zip(one["completions"], other["completions"]):
            assert torch.equal(mine, theirs)  # each rank got exactly the rows it generates itself
        if engine == "ddp":
            assert other["loss"] == one["loss"]
            for name, value in one["params"].items():
                assert torch.equal(other["params"][name], value), name
        else:  # the actor's float32 forward on the gathered weights and the sharded trainer's round apart (6e-8)
            assert other["loss"] == pytest.approx(one["loss"], abs=1e-6)
            for name, value in one["params"].items():
                torch.testing.assert_close(other["params"][name], value, atol=1e-6, rtol=0, msg=name)
    # the two ranks' rounds differ: each got its own share, not rank 0's
    assert not torch.equal(actors[0]["completions"][0], actors[1]["completions"][0])
    assert actors[0]["staleness_max"] == [0.0, 0.0, 0.0]
    # the weights of each push (versions 0..3, in-flight updates push every step's): under DDP rank 0's own (rank 1
    # gathers nothing); under FSDP2 every rank gathers the shards together
    if engine == "ddp":
        assert actors[0]["gathers"] == [False] * 4 and actors[1]["gathers"] == []
    else:
        assert actors[0]["gathers"] == actors[1]["gathers"] == [True] * 4


def test_one_round_ahead_finishes_within_max_staleness(tmp_path, tiny_model_path):
    ranks = _launch(tmp_path / "ahead", tiny_model_path, "ray", "1")
    assert len(ranks[0]["loss"]) == 3 and all(len(r["completions"]) == 3 for r in ranks)
    assert ranks[0]["staleness_max"] == [0.0, 1.0, 1.0]  # round t sampled with the weights of step t - 1


def test_sigterm_on_every_rank_checkpoints_and_resuming_is_exact(tmp_path, tiny_model_path):
    """Two rounds ahead, a push every 2 steps; SIGTERM to both ranks after step 1. The checkpoint holds rounds 1-2
    (every rank's, on rank 0) and the sampler's weights of version 0; the resumed run's new actors sample round 3
    with those weights and round 4 with version 2: losses and final parameters are the whole run's on each rank."""
    whole = _launch(tmp_path / "whole", tiny_model_path, "ray", "2", "whole")
    run, stop = tmp_path / "run", 1
    output = _run(run, tiny_model_path, "ray", "2", "stop", str(stop))
    assert output.count(f"stopped by SIGTERM after step {stop}") == 2, output[-3000:]  # each rank, at one step
    checkpoint = run / f"checkpoint-{stop}"
    assert (checkpoint / CHECKPOINT_MARKER).exists() and not list(run.glob("rank*.pt"))
    saved = torch.load(checkpoint / TRAINER_STATE_FILE, weights_only=False)["async_rollouts"]
    assert sorted(saved["rounds"]) == [1, 2] and saved["version"] == 0 and saved["weights"] is not None
    assert len(saved["rounds"][1][0]) == 2 * 2 * 4  # the round of both ranks: 2 prompts each, 4 completions
    resumed = _launch(run, tiny_model_path, "ray", "2", "resume")
    assert whole[0]["staleness_max"] == [0.0, 1.0, 2.0, 3.0, 2.0]  # round 3 reuses version 0, round 4 takes 2
    for one, other in zip(whole, resumed):
        assert one["steps"] == other["steps"] == [1, 2, 3, 4, 5]
        assert other["loss"][stop:] == one["loss"][stop:]
        assert len(other["completions"]) == 4
        for mine, theirs in zip(one["completions"][stop:], other["completions"]):
            assert torch.equal(mine, theirs)
        for name, value in one["params"].items():
            assert torch.equal(other["params"][name], value), name
