"""One SGD step of SFTTrainer, run by tests/trainers/test_sft_distributed.py in one process or under
`python -m torch.distributed.run`; each rank saves what it saw and computed to `<out_dir>/rank<r>.pt`.

Usage: python tests/_sft_ddp_worker.py MODEL_PATH OUT_DIR PER_DEVICE_BATCH_SIZE
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist
from datasets import Dataset

from posttrain import SFTConfig, SFTTrainer

LEARNING_RATE = 0.5


def varied_length_data() -> Dataset:
    """Prompt-completion rows whose completions differ a lot in length, so that averaging per
    process (or per row) would give a different loss than averaging over all trained tokens."""
    words = ["red", "green", "blue", "cat", "dog", "sun", "moon", "tree"]
    return Dataset.from_list(
        [{"prompt": f"say {words[i]}", "completion": " " + " ".join(words[: 1 + (5 * i) % 8])} for i in range(8)]
    )


class RecordingSFTTrainer(SFTTrainer):
    """Keeps the first training loss and the rows this process trained on."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.rows_seen: list[tuple[list[int], list[int]]] = []  # (input_ids, labels) without padding

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        if model.training:
            mask = inputs["attention_mask"].bool()
            self.rows_seen += [
                (ids[m].tolist(), labels[m].tolist())
                for ids, labels, m in zip(inputs["input_ids"], inputs["labels"], mask)
            ]
        return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)


def train_one_step(model_path: str, out_dir: str, per_device_batch_size: int) -> dict:
    """Trains one SGD step and returns the logged loss, the updated parameters and what was seen."""
    args = SFTConfig(
        output_dir=out_dir,
        per_device_train_batch_size=per_device_batch_size,
        max_steps=1,
        learning_rate=LEARNING_RATE,
        optim="sgd",
        lr_scheduler_type="constant",
        max_grad_norm=0.0,
        logging_steps=1,
        seed=0,
        max_length=64,
        use_cpu=True,
        bf16=False,
        ddp_backend="gloo",
        report_to="none",
        save_strategy="no",
        disable_tqdm=True,
    )
    trainer = RecordingSFTTrainer(model_path, args=args, train_dataset=varied_length_data())
    trainer.train()
    logged = next(h for h in trainer.state.log_history if "loss" in h)
    return {
        "rank": trainer.args.process_index,
        "world_size": trainer.args.world_size,
        "dist_world_size": dist.get_world_size() if dist.is_initialized() else 1,
        "loss": logged["loss"],
        "mean_token_accuracy": logged["mean_token_accuracy"],
        "num_tokens_trained": logged["num_tokens_trained"],
        "rows_seen": trainer.rows_seen,
        "params": {n: p.detach().clone() for n, p in trainer.model.named_parameters()},
    }


def main() -> None:
    model_path, out_dir, per_device = sys.argv[1], sys.argv[2], int(sys.argv[3])
    result = train_one_step(model_path, out_dir, per_device)
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        assert result["world_size"] == 2 and result["dist_world_size"] == 2, result
    torch.save(result, os.path.join(out_dir, f"rank{result['rank']}.pt"))


if __name__ == "__main__":
    main()
