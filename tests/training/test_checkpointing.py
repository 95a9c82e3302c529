"""Checkpoints: an interrupted save is never resumed from, and resuming reproduces the uninterrupted run."""

import os

import torch
from datasets import Dataset

from posttrain import SFTConfig, SFTTrainer


def _trainer(out, model_path, max_steps):
    data = Dataset.from_list([{"prompt": f"{i} plus {i}", "completion": f" is {2 * i}"} for i in range(16)])
    args = SFTConfig(
        output_dir=str(out),
        per_device_train_batch_size=4,
        max_steps=max_steps,
        save_steps=2,
        learning_rate=1e-2,
        lr_scheduler_type="constant",
        use_cpu=True,
        bf16=False,
        report_to="none",
        disable_tqdm=True,
        seed=0,
        logging_steps=1,
    )
    return SFTTrainer(model_path, args=args, train_dataset=data)


def _params(trainer):
    return {n: p.detach().clone() for n, p in trainer.model.named_parameters()}


def test_resume_reproduces_the_uninterrupted_run_and_skips_partial_saves(tmp_path, tiny_model_path):
    straight = _trainer(tmp_path / "straight", tiny_model_path, 6)
    straight.train()

    run = tmp_path / "run"
    _trainer(run, tiny_model_path, 4).train()
    assert os.path.exists(run / "checkpoint-4" / SFTTrainer.CHECKPOINT_MARKER)
    # A crash while writing checkpoint-4: its marker was never written (and the weights are garbage).
    os.remove(run / "checkpoint-4" / SFTTrainer.CHECKPOINT_MARKER)
    (run / "checkpoint-4" / "model.safetensors").write_bytes(b"torn write")

    resumed = _trainer(run, tiny_model_path, 6)
    assert resumed.last_complete_checkpoint() == str(run / "checkpoint-2")
    resumed.train(resume_from_checkpoint=True)
    assert resumed.state.global_step == 6
    expected = _params(straight)
    for name, value in _params(resumed).items():
        torch.testing.assert_close(value, expected[name], atol=1e-6, rtol=1e-5)
