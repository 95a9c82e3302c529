"""Trains GRPO for 3 steps in each process of an `accelerate launch` (tests/dist/test_ray_ranks.py): with the
synchronous producer, or with rollout_backend="ray" (rank 0 starts a loopback Ray and 2 rollout actors). Saves each
rank's losses, logged staleness, every round's completion ids, its gathers of the weights for a push and the final
full parameters.

Usage: python ray_worker.py OUT_DIR MODEL PER_DEVICE_BATCH (sync | ray ROUNDS_AHEAD)
Writes OUT_DIR/rank<r>.pt (a failure writes its traceback instead).
"""

from __future__ import annotations

import os
import sys
import traceback

import torch
from worker import _prompts, _stopping_model, full_parameters, low_id_fraction


def build(out_dir: str, model: str, per_device: int, mode: str, ahead: int | None):
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
    return pt.GRPOTrainer(_stopping_model(model), low_id_fraction, args=pt.GRPOConfig(**settings),
                          train_dataset=_prompts(16))


def count_gathers() -> list[bool]:
    """Whether the parameters were sharded (FSDP2) at each gather of the weights for a push, on this rank."""
    from posttrain.online.producers import ray_ranks

    gathers, plain = [], ray_ranks.gathered_params

    def counting(model):
        gathers.append(any(hasattr(p, "full_tensor") for p in model.parameters()))
        return plain(model)

    ray_ranks.gathered_params = counting
    return gathers


def main() -> None:
    out_dir, model, per_device, mode = sys.argv[1:5]
    ahead = int(sys.argv[5]) if mode == "ray" else None
    rank = int(os.environ.get("RANK", "0"))
    gathers = count_gathers()
    try:
        trainer = build(out_dir, model, int(per_device), mode, ahead)
        completions, make = [], trainer.make_rollout

        def recording(*args, **kwargs):
            rollout = make(*args, **kwargs)
            completions.append(rollout.completion_ids.clone())
            return rollout

        trainer.make_rollout = recording
        initial = full_parameters(trainer.model)
        trainer.train()
        logs = [h for h in trainer.state.log_history if "loss" in h]
        params = full_parameters(trainer.model_wrapped)
        result = {
            "world_size": trainer.accelerator.num_processes,
            "producer": type(trainer.rollout_producer).__name__,
            "loss": [h["loss"] for h in logs],
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
