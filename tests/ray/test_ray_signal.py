"""SIGTERM on a trainer with rollout actors in flight (rollout_backend="ray"): the trainer, a process of its own
that joins the test's cluster, finishes the step, writes its checkpoint with the rounds sampled ahead (k = 2) and,
since vllm_sync_steps=2 lets a later round reuse them, the sampler's weights, ends its actors and exits 0; resumed
from that checkpoint, the run ends with an uninterrupted run's losses and parameters, bit for bit.

ray.init replaces the process's SIGTERM handler by one that exits at once (producers/ray_cluster.py keeps the
trainer's), which only a trainer that calls ray.init itself shows: hence the subprocess.

A trainer that started its own Ray (ray_address=None: a new Ray on 127.0.0.1) checkpoints on SIGTERM the same
way, exits 0 and leaves none of that Ray's processes behind (its head's, its actors', none of its session's).

This file is also the trainer (RAY_ADDRESS "none": the run starts its own Ray):
    python tests/ray/test_ray_signal.py MODEL_PATH OUT_DIR RAY_ADDRESS STOP_STEP SETTINGS_JSON
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch
from _paths import subprocess_pythonpath
from transformers import TrainerCallback

from posttrain.training.checkpoints import CHECKPOINT_MARKER, TRAINER_STATE_FILE

pytestmark = [pytest.mark.ray]
ACTORS = dict(rollout_backend="ray", num_rollout_actors=2)


class SignalAt(TrainerCallback):
    """SIGTERM to this process at the end of optimizer step `step` (what a scheduler sends before it kills)."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.step:
            os.kill(os.getpid(), signal.SIGTERM)


class ReportRay(TrainerCallback):
    """Prints, once the actors run (after step 1), the Ray this process belongs to: its session directory, the
    processes this process started (where it started Ray: the head's, the raylet's workers, its actors') and
    every address the cluster uses."""

    def __init__(self, trainer) -> None:
        self.trainer = trainer

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == 1:
            import ray

            from posttrain.online.producers.ray_cluster import loopback_addresses

            actors = [where["pid"] for where in self.trainer.rollout_producer.where]
            session = ray._private.worker._global_node.get_session_dir_path()
            found = {"session": session, "pids": descendants(os.getpid()), "actors": actors}
            found["addresses"] = loopback_addresses()
            print(f"ray: {json.dumps(found)}", flush=True)


def trainer_process(model_path: str, out_dir: str, address: str, stop: int, settings: dict) -> None:
    from test_producers_thread import grpo

    address = None if address == "none" else address
    trainer = grpo(model_path, out_dir, callbacks=[SignalAt(stop)], ray_address=address, **settings, **ACTORS)
    trainer.add_callback(ReportRay(trainer))
    try:
        trainer.train()
    finally:
        print(f"actors after training: {trainer.rollout_producer.actors}", flush=True)


def alive_actors() -> list[dict]:
    return [a for a in ray_state().actors().values() if a["State"] != "DEAD"]


def ray_state():
    import ray

    return ray._private.state


def run_trainer(model_path, run, address: str, stop: int, settings: dict) -> str:
    """The trainer of this file in a process of its own, sent SIGTERM after step `stop`; checks that it
    checkpointed, ended its actors and exited 0, and returns its output."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=subprocess_pythonpath())
    env.pop("RAY_ADDRESS", None)
    command = [sys.executable, __file__, str(model_path), str(run), address, str(stop), json.dumps(settings)]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-4000:]
    assert f"stopped by SIGTERM after step {stop}" in output, output[-4000:]
    assert "actors after training: None" in output  # the trainer ended its actors before it exited
    assert (run / f"checkpoint-{stop}" / CHECKPOINT_MARKER).exists()
    return output


def test_sigterm_checkpoints_with_actors_in_flight_and_resuming_is_exact(
    ray_cluster, tmp_path, tiny_model_path, uninterrupted, faulty_settings
):
    from test_producers_process import assert_same_parameters
    from test_producers_thread import grpo, losses

    run, stop = tmp_path / "run", 2
    run_trainer(tiny_model_path, run, ray_cluster.address, stop, faulty_settings)
    checkpoint = run / f"checkpoint-{stop}"
    saved = torch.load(checkpoint / TRAINER_STATE_FILE, weights_only=False)["async_rollouts"]
    ahead = faulty_settings["async_generation_rounds"]
    assert sorted(saved["rounds"]) == list(range(stop, stop + ahead))  # the rounds sampled ahead went in
    assert saved["weights"] is not None  # vllm_sync_steps > 1: a round after the checkpoint reuses these weights
    deadline = time.monotonic() + 30
    while alive_actors() and time.monotonic() < deadline:
        time.sleep(0.5)
    assert alive_actors() == []

    resumed = grpo(tiny_model_path, run, **faulty_settings, **ACTORS)
    resumed.train(resume_from_checkpoint=True)
    assert resumed.state.global_step == faulty_settings["max_steps"]
    assert {s: v for s, v in losses(resumed).items() if s > stop} == {
        s: v for s, v in losses(uninterrupted).items() if s > stop
    }
    assert_same_parameters(uninterrupted, resumed)
    assert resumed.rollout_producer.actors is None and alive_actors() == []


def test_sigterm_on_a_trainer_that_started_its_own_ray_leaves_none_of_it(tmp_path, tiny_model_path):
    run, stop = tmp_path / "own", 2
    output = run_trainer(tiny_model_path, run, "none", stop, dict(max_steps=3, async_generation_rounds=1))
    found = json.loads(output.split("ray: ", 1)[1].splitlines()[0])
    assert found["addresses"] and all(host.startswith("127.") for host in found["addresses"].values()), found
    assert set(found["actors"]) <= set(found["pids"]) and len(found["pids"]) >= 4  # gcs_server, raylet, actors
    session = os.path.basename(found["session"])
    deadline = time.monotonic() + 30
    while (left := ray_processes(found["pids"], session)) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert left == {}, left


def processes() -> dict[int, tuple[int, str, str]]:
    """Every process on this machine, by pid: its parent's pid, its state and its command line."""
    found = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as file:
                command = file.read().replace(b"\0", b" ").decode(errors="replace")
            with open(f"/proc/{entry}/stat") as file:
                state, parent = file.read().rpartition(")")[2].split()[:2]
        except OSError:  # ended meanwhile
            continue
        found[int(entry)] = (int(parent), state, command)
    return found


def descendants(pid: int) -> list[int]:
    """The processes `pid` started, and theirs, down the tree."""
    children: dict[int, list[int]] = {}
    for child, (parent, _, _) in processes().items():
        children.setdefault(parent, []).append(child)
    found, todo = [], list(children.get(pid, []))
    while todo:
        found.append(todo.pop())
        todo += children.get(found[-1], [])
    return found


def ray_processes(pids: list[int], session: str) -> dict[int, str]:
    """The processes still running (not zombies) that are among `pids` or name the Ray session `session` in
    their command line, by pid: their command lines."""
    return {
        pid: command[:200]
        for pid, (_, state, command) in processes().items()
        if state != "Z" and (pid in pids or session in command)
    }


if __name__ == "__main__":
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    os.environ.setdefault("RAY_ENABLE_UV_RUN_RUNTIME_ENV", "0")
    trainer_process(sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), json.loads(sys.argv[5]))
