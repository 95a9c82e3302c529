"""Experimental trainers: newer methods built from the same pieces as the stable ones (data preparation,
losses, generation backends). Their names, settings and behaviour may change between releases.

On-policy distillation (GKD, Agarwal et al. 2024): with probability `lmbda` a micro-batch's completions are
replaced by ones the student samples itself, and the student is then distilled from the teacher on its own
samples (the teacher scores the student's mistakes, which fixed data never shows it). Prompts and samples
stay token ids end to end: nothing is decoded and re-tokenized.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from ..errors import ConfigError, DataError
from ..generation import SamplingParams, create_generation_backend, derive_seed
from ..losses.sft import IGNORE_INDEX
from ..trainers.distillation import DistillationConfig, DistillationTrainer


@dataclass
class OnPolicyDistillationConfig(DistillationConfig):
    lmbda: float = field(
        default=0.5, metadata={"help": "Fraction of micro-batches whose completions the student samples itself "
                                       "(0: the data's completions only, 1: always the student's)."})
    max_new_tokens: int = field(
        default=128, metadata={"help": "Most tokens the student samples per completion (at `temperature`)."})

    def __post_init__(self):
        if not 0 <= self.lmbda <= 1:
            raise ConfigError(f"lmbda={self.lmbda} must lie in [0, 1] (the fraction of on-policy micro-batches).")
        if self.padding_free or self.packing:
            raise ConfigError("On-policy distillation samples completions per row of a padded batch; set "
                              "padding_free=False and packing=False.")
        super().__post_init__()


class OnPolicyDistillationTrainer(DistillationTrainer):
    """`OnPolicyDistillationTrainer(model, teacher_model, args=OnPolicyDistillationConfig(...), train_dataset=...)`.

    The prompt of a row is everything before its first trained token (the prompt of prompt-completion data,
    the conversation up to the first assistant turn); the sampled completion replaces all that follows.
    Whether a micro-batch is on-policy is drawn from a generator seeded with `seed`, the same on every
    process. Sampling happens when the effective batch is assembled, so the loss is still normalised by the
    trained tokens actually used. Logs `on_policy`, the fraction of on-policy micro-batches.
    """

    def __init__(self, model, teacher_model=None, args: OnPolicyDistillationConfig | None = None, *a, **kw):
        args = args or OnPolicyDistillationConfig(output_dir="outputs/on_policy_distillation")
        super().__init__(model, teacher_model, args, *a, **kw)
        self._sampler = create_generation_backend(self.model, self.processing_class, args)
        self._sampling = SamplingParams(max_tokens=args.max_new_tokens, temperature=args.temperature)
        self._coin = random.Random(args.seed)

    def get_batch_samples(self, epoch_iterator, num_batches, device):
        batches, _ = super().get_batch_samples(epoch_iterator, num_batches, device)
        flags = [self._coin.random() < self.args.lmbda for _ in batches]
        batches = [self._student_batch(b, i) if on else b for i, (b, on) in enumerate(zip(batches, flags))]
        self._metrics["train"]["on_policy"].extend(float(on) for on in flags)
        return batches, self._get_num_items_in_batch(batches, device)

    def _student_batch(self, batch: dict, index: int) -> dict:
        """The batch with each row's completion replaced by one the student samples for the row's prompt."""
        prompts = []
        for row, labels in enumerate(batch["labels"]):
            start = int((labels != IGNORE_INDEX).nonzero()[0])
            if start == 0:
                raise DataError(f"A row of the batch (number {row}) is trained from its first token, so it has no "
                                "prompt to sample a completion for. On-policy distillation needs prompt-completion "
                                "or conversational data.")
            prompts.append(batch["input_ids"][row, :start].tolist())
        seed = derive_seed(self.args.seed, self.state.global_step, index, self.accelerator.process_index)
        completions = self._sampler.generate(prompts, 1, self._sampling, seed=seed)
        return self.data_collator([
            {"input_ids": prompt + c.token_ids, "completion_mask": [0] * len(prompt) + [1] * len(c.token_ids)}
            for prompt, c in zip(prompts, completions)
        ])


__all__ = ["OnPolicyDistillationConfig", "OnPolicyDistillationTrainer"]
