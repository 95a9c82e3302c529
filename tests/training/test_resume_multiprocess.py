"""Exact resume across processes (issue #15): SFT and GRPO on two CPU processes (torch.distributed.run, gloo),
6 steps straight equal 3 steps, a checkpoint, the end of those processes, and 3 more steps in NEW processes resuming
from it: the same weights (to 1e-6) on both ranks, and the same losses for steps 4-6.

This file is also the worker that torch.distributed.run launches:
    python -m torch.distributed.run --standalone --nproc_per_node 2 tests/training/test_resume_multiprocess.py \
        MODE MODEL_PATH OUT_DIR KIND...       (MODE: straight | interrupted | resumed)
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from _paths import subprocess_pythonpath

STEPS, STOP = 6, 3
KINDS = ("sft", "grpo")
REPO_ROOT = Path(__file__).resolve().parents[2]
WORDS = "cat dog sun moon tree fish bird sky red green blue one two three".split()


def _low_ids(completion_ids, **kwargs):
    """The fraction of a completion's tokens with an id below 192: about half for the random tiny model."""
    return [sum(t < 192 for t in ids) / max(len(ids), 1) for ids in completion_ids]


def _trainer(kind: str, model_path: str, out: str, callbacks):
    from datasets import Dataset

    common = dict(
        output_dir=out,
        max_steps=STEPS,
        save_strategy="steps",
        save_steps=STOP,
        logging_steps=1,
        learning_rate=1e-2,
        seed=0,
        use_cpu=True,
        bf16=False,
        ddp_backend="gloo",
        report_to="none",
        disable_tqdm=True,
        write_report=False,
        per_device_train_batch_size=2,
    )
    if kind == "sft":
        from posttrain import SFTConfig, SFTTrainer

        data = Dataset.from_list(
            [
                {
                    "prompt": f"{WORDS[i % 14]} {WORDS[(3 * i) % 14]}",
                    "completion": " " + " ".join(WORDS[(i + j) % 14] for j in range(1 + i % 4)),
                }
                for i in range(24)
            ]
        )
        return SFTTrainer(model_path, args=SFTConfig(**common, max_length=64), train_dataset=data, callbacks=callbacks)
    from posttrain.trainers.grpo import GRPOConfig, GRPOTrainer

    data = Dataset.from_list([{"prompt": f"{WORDS[i % 14]} {i} and {WORDS[(3 * i) % 14]}"} for i in range(24)])
    args = GRPOConfig(**common, num_generations=2, max_completion_length=6)
    return GRPOTrainer(model_path, _low_ids, args=args, train_dataset=data, callbacks=callbacks)


def _worker(mode: str, model_path: str, out_dir: str, kinds: list[str]) -> None:
    from transformers import TrainerCallback

    class StopAfter(TrainerCallback):
        """Ends the run after step STOP (its checkpoint written), as a job that runs out of time would."""

        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step == STOP:
                control.should_training_stop = True

    for kind in kinds:
        run_dir = os.path.join(out_dir, kind, "straight" if mode == "straight" else "run")
        trainer = _trainer(kind, model_path, run_dir, [StopAfter()] if mode == "interrupted" else None)
        trainer.train(resume_from_checkpoint=True if mode == "resumed" else None)
        result = {
            "world_size": trainer.args.world_size,
            "step": trainer.state.global_step,
            "losses": {h["step"]: h["loss"] for h in trainer.state.log_history if "loss" in h},
            "params": {n: p.detach().clone() for n, p in trainer.model.named_parameters()},
        }
        torch.save(result, os.path.join(out_dir, f"{kind}.{mode}.rank{trainer.args.process_index}.pt"))


def _launch(mode: str, model_path: str, out_dir: Path) -> None:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=subprocess_pythonpath())
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node",
        "2",
        __file__,
        mode,
        model_path,
        str(out_dir),
        *KINDS,
    ]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, f"{mode}:\n" + done.stdout[-3000:] + done.stderr[-5000:]


@pytest.mark.slow
def test_two_process_runs_resume_in_new_processes_to_the_same_weights(tmp_path, tiny_model_path):
    model_path = str(tiny_model_path)
    for mode in ("straight", "interrupted", "resumed"):
        _launch(mode, model_path, tmp_path)
    for kind in KINDS:

        def load(mode, rank, kind=kind):
            return torch.load(tmp_path / f"{kind}.{mode}.rank{rank}.pt")

        straight, stopped = load("straight", 0), load("interrupted", 0)
        assert straight["world_size"] == 2 and (straight["step"], stopped["step"]) == (STEPS, STOP)
        assert (tmp_path / kind / "run" / f"checkpoint-{STOP}").is_dir()
        initial = stopped["params"]
        moved = max((straight["params"][n] - initial[n]).abs().max().item() for n in initial)
        assert moved > 1e-4, "steps 4-6 must change the weights, or equal weights would prove nothing"
        for rank in (0, 1):
            resumed = load("resumed", rank)
            assert resumed["step"] == STEPS
            for name, value in straight["params"].items():
                torch.testing.assert_close(resumed["params"][name], value, atol=1e-6, rtol=0, msg=f"{kind} {name}")
            later = {s: v for s, v in straight["losses"].items() if s > STOP}
            assert sorted(later) == list(range(STOP + 1, STEPS + 1))
            assert {s: resumed["losses"][s] for s in later} == pytest.approx(later, rel=1e-5, abs=1e-6)


if __name__ == "__main__":
    _worker(sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4:])
