"""GRPO in vLLM server mode for test_vllm_dist.py: run once in a plain process (per-device batch 2b) and once under
`accelerate launch --config_file examples/accelerate_configs/ddp.yaml` (2 processes, batch b), both against the same
server. Saves, per process, the logged losses, the final parameters, and every round's prompts, completions and
sampler log-probs.

Usage: python _dist_worker.py OUT_DIR PER_DEVICE_BATCH MODEL SERVER_URL
"""

from __future__ import annotations

import os
import sys

import torch
from datasets import Dataset

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _vllm_reference import low_id_fraction  # noqa: E402


def main() -> None:
    from posttrain import GRPOConfig, GRPOTrainer

    out_dir, per_device, model, url = sys.argv[1:5]
    # SGD at a constant rate: equal gradients give equal weights without Adam magnifying rounding. Without the
    # importance-sampling correction the loss does not read the sampler's log-probs, which are compared apart.
    config = GRPOConfig(
        output_dir=out_dir,
        per_device_train_batch_size=int(per_device),
        num_generations=4,
        max_completion_length=8,
        max_steps=3,
        learning_rate=0.5,
        optim="sgd",
        lr_scheduler_type="constant",
        max_grad_norm=0.0,
        logging_steps=1,
        seed=0,
        report_to="none",
        save_strategy="no",
        disable_tqdm=True,
        write_report=False,
        bf16=False,  # float32: the processes must compute what one process does
        use_vllm=True,
        vllm_mode="server",
        vllm_server_base_url=url,
        vllm_importance_sampling_correction=False,
    )
    dataset = Dataset.from_list([{"prompt": f"cat {i} and dog {2 * i}"} for i in range(16)])
    trainer = GRPOTrainer(model, low_id_fraction, args=config, train_dataset=dataset)
    backend, rounds = trainer.generation_backend, []
    generate = backend.generate

    def recording_generate(prompt_ids, n, sampling, seed=None):
        completions = generate(prompt_ids, n, sampling, seed)
        rounds.append([(list(prompt_ids[c.prompt_index]), c.token_ids, c.logprobs) for c in completions])
        return completions

    backend.generate = recording_generate
    trainer.train()
    logs = [h for h in trainer.state.log_history if "loss" in h]
    result = {
        "world_size": trainer.accelerator.num_processes,
        "loss": [h["loss"] for h in logs],
        "logs": logs,
        "rounds": rounds,
        "pushes": backend.pushes,
        "sync_dir": str(backend.sync_dir),
        "params": {
            n: p.detach().clone() for n, p in trainer.accelerator.unwrap_model(trainer.model).named_parameters()
        },
    }
    torch.save(result, os.path.join(out_dir, f"rank{trainer.accelerator.process_index}.pt"))


if __name__ == "__main__":
    main()
