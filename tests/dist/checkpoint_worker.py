"""Checkpoints at scale: per trainer, trains 4 steps saving a checkpoint after step 2; resumes a fresh trainer from
that checkpoint to step 4; exports the first run's model with `trainer.save_model`. tests/dist/test_checkpoints.py launches it under the FSDP2 and ZeRO-3 configs.

Usage: python checkpoint_worker.py OUT_DIR TRAINERS MODEL
Writes OUT_DIR/<trainer>.rank<r>.pt (the losses, full parameters, checkpoint file names), or the traceback of a
failure; the exports go to OUT_DIR/export/<trainer> (and, under FSDP, OUT_DIR/export_fsdp/<trainer> written by
distributed.save_full_model_under_fsdp).
"""

from __future__ import annotations

import os
import sys
import traceback

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from worker import build, full_parameters  # noqa: E402

STEPS, SAVE_AT, PER_DEVICE = 4, 2, 2


def _run(name: str, out_dir: str, model: str, resume: str | None = None):
    from transformers import TrainerCallback

    class CountSteps(TrainerCallback):
        steps = 0

        def on_step_end(self, args, state, control, **kwargs):
            CountSteps.steps += 1

    # AdamW, so that the optimizer's sharded state matters to an exact resume
    trainer = build(name, os.path.join(out_dir, "resumed" if resume else "full"), PER_DEVICE, model, model, model,
                    max_steps=STEPS, save_strategy="no" if resume else "steps", save_steps=SAVE_AT,
                    optim="adamw_torch", learning_rate=0.01)
    trainer.add_callback(CountSteps)
    trainer.train(resume_from_checkpoint=resume)
    trainer.steps_run = CountSteps.steps
    return trainer, [h["loss"] for h in trainer.state.log_history if "loss" in h]


def check(name: str, out_dir: str, model: str) -> dict:
    full, losses = _run(name, out_dir, model)
    checkpoint = os.path.join(out_dir, "full", name, f"checkpoint-{SAVE_AT}")
    files = sorted(os.path.relpath(os.path.join(d, f), checkpoint) for d, _, fs in os.walk(checkpoint) for f in fs)
    result = {"distributed_type": str(full.accelerator.distributed_type), "loss": losses,
              "params": full_parameters(full.model_wrapped), "checkpoint_files": files}
    full.save_model(os.path.join(out_dir, "export", name))  # the test loads it in a plain process
    from posttrain.runtime.distributed import save_full_model_under_fsdp

    save_full_model_under_fsdp(full, os.path.join(out_dir, "export_fsdp", name))
    full.accelerator.wait_for_everyone()
    del full
    resumed, resumed_losses = _run(name, out_dir, model, resume=checkpoint)
    result.update(resumed_loss=resumed_losses, resumed_params=full_parameters(resumed.model_wrapped),
                  resumed_step=resumed.state.global_step, resumed_steps_run=resumed.steps_run)
    return result


def main() -> None:
    out_dir, names, model = sys.argv[1:4]
    rank = int(os.environ.get("RANK", "0"))
    os.makedirs(out_dir, exist_ok=True)
    for name in names.split(","):
        try:
            result = check(name, out_dir, model)
        except Exception:  # one trainer's failure must not hide the others' results
            result = {"error": traceback.format_exc()}
        torch.save(result, os.path.join(out_dir, f"{name}.rank{rank}.pt"))
        if torch.distributed.is_initialized():
            torch.distributed.barrier()


if __name__ == "__main__":
    main()
