"""Trains GRPO for 3 steps in each process of an `accelerate launch` (tests/dist/test_ray_ranks.py): with the
synchronous producer, or with rollout_backend="ray" (rank 0 starts a loopback Ray and 2 rollout actors). Saves each
rank's losses, logged staleness, every round's completion ids, its gathers of the weights for a push and the final
full parameters.

A resumable run (ROUNDS_AHEAD followed by a phase) trains 5 steps whose rounds name their weights (a push every 2
steps, no in-flight updates): `whole` runs them all, `stop STEP` sends SIGTERM to every rank at the end of step
STEP (the run checkpoints and exits 0, writing no result), `resume` continues from the newest checkpoint in OUT_DIR.

Usage: python ray_worker.py OUT_DIR MODEL PER_DEVICE_BATCH (sync | ray ROUNDS_AHEAD [whole | stop STEP | resume])
Writes OUT_DIR/rank<r>.pt (a failure writes its traceback instead).
"""

from __future__ import annotations

import os
import signal
import sys
import traceback

import torch
from worker import _prompts, _stopping_model, full_parameters, low_id_fraction


# Rounds name their weights (as in tests/ray/test_ray_signal.py), so a resumed run must equal the whole one. With
# 2 rounds ahead and a push every 2 steps, a stop after step 1 saves rounds 1-2 and the weights of version 0, which
# round 3 (sampled after the resume, by new actors) reuses; round 4 takes version 2. No round is dropped as stale.
RESUMABLE = dict(max_steps=5, vllm_sync_steps=2, async_inflight_weight_updates=False, max_staleness=None)


def build(out_dir: str, model: str, per_device: int, mode: str, ahead: int | None, phase: list[str]):
    import posttrain as pt

    settings = dict(
        output_dir=out_dir, per_device_train_batch_size=per_device, num_generations=4, max_completion_length=8,
        max_steps=3, logging_steps=1, seed=0, report_to="none", save_strategy="no", disable_tqdm=True,
        write_report=False, temperature=1.0, bf16=False,
        # SGD as in worker.py: Adam's first step is about lr x sign(gradient), which turns a rounding difference
        # in a near-zero gradient into a step of lr
        optim="sgd", learning_rate=0.5, lr_scheduler_type="constant", max_grad_norm=0.0,
    )
    if mode == "ray":
        settings.update(rollout_backend="ray", num_rollout_actors=2, async_generation_rounds=ahead,
                        max_staleness=ahead)
        settings.update(RESUMABLE if phase else {})
    callbacks = [signal_at(int(phase[1]))] if phase[:1] == ["stop"] else None
    return pt.GRPOTrainer(_stopping_model(model), low_id_fraction, args=pt.GRPOConfig(**settings),
                          train_dataset=_prompts(16), callbacks=callbacks)


def count_gathers() -> list[bool]:
    """Whether the parameters were sharded (FSDP2) at each gather of the weights for a push, on this rank."""
    from posttrain.online.producers import ray_ranks

    gathers, plain = [], ray_ranks.gathered_params

    def counting(model):
        gathers.append(any(hasattr(p, "full_tensor") for p in model.parameters()))
        return plain(model)

    ray_ranks.gathered_params = counting
    return gathers


def signal_at(step: int):
    """A callback sending SIGTERM to this process at the end of optimizer step `step` (as a scheduler signals
    every task of a job)."""
    from transformers import TrainerCallback

    class SignalAt(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step == step:
                os.kill(os.getpid(), signal.SIGTERM)

    return SignalAt()


def main() -> None:
    out_dir, model, per_device, mode = sys.argv[1:5]
    ahead = int(sys.argv[5]) if mode == "ray" else None
    phase = sys.argv[6:]  # a resumable run's: [], ["whole"], ["stop", STEP] or ["resume"]
    rank = int(os.environ.get("RANK", "0"))
    gathers = count_gathers()
    try:
        trainer = build(out_dir, model, int(per_device), mode, ahead, phase)
        completions, make = [], trainer.make_rollout

        def recording(*args, **kwargs):
            rollout = make(*args, **kwargs)
            completions.append(rollout.completion_ids.clone())
            return rollout

        trainer.make_rollout = recording
        initial = full_parameters(trainer.model)
        trainer.train(resume_from_checkpoint=phase == ["resume"] or None)  # "stop": exits 0 at the signal
        logs = [h for h in trainer.state.log_history if "loss" in h]
        params = full_parameters(trainer.model_wrapped)
        result = {
            "world_size": trainer.accelerator.num_processes,
            "producer": type(trainer.rollout_producer).__name__,
            "loss": [h["loss"] for h in logs],
            "steps": [h["step"] for h in logs],
            "staleness_max": [h.get("sample/staleness_max") for h in logs],
            "completions": completions,
            "params": params,
            "gathers": gathers,
            "moved": max((params[n] - p).abs().max().item() for n, p in initial.items()),
        }
    except Exception:
        result = {"error": traceback.format_exc()}
    torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))


if __name__ == "__main__":
    main()
