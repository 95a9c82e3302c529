"""Completion logging: what the model says to a few eval prompts as training goes."""

from __future__ import annotations

import json
import logging
import os

from transformers import TrainerCallback

from posttrain.callbacks.completions import eval_prompts, generate_completions, raw_prompts

logger = logging.getLogger("posttrain")


class LogCompletionsCallback(TrainerCallback):
    """Logs sample completions of the model while it trains, to see what it writes.

    Every `freq` steps (default: the trainer's ``eval_steps``, else ``logging_steps``) generates a completion
    for each of the first `num_prompts` prompts of the trainer's eval dataset and records ``(step, prompt,
    completion)``.

    TRL sends the table to Weights & Biases / Comet. posttrain has no tracker tables yet: each record is
    appended as a JSON line to ``<output_dir>/completions.jsonl`` and the rows are kept in ``self.table``; a
    ``wandb.Table`` is logged too when ``report_to`` includes wandb and wandb is installed. Conversational
    prompts are rendered with the chat template (with the generation prompt).

    See docs/trackers.md.
    """

    def __init__(self, trainer, generation_config=None, num_prompts: int | None = None, freq: int | None = None):
        self.trainer, self.generation_config, self.freq = trainer, generation_config, freq
        self.eval_dataset = eval_prompts(trainer, num_prompts, "LogCompletionsCallback")
        self.prompts = raw_prompts(self.eval_dataset, "LogCompletionsCallback")
        self.table: list[tuple[str, str, str]] = []
        self._last_logged_step = -1

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self._last_logged_step:
            return
        freq = self.freq or state.eval_steps or args.logging_steps
        if not freq or state.global_step % freq != 0:
            return
        tokenizer = kwargs.get("processing_class") or self.trainer.processing_class
        tokenizer = getattr(tokenizer, "tokenizer", tokenizer)  # a processor's text tokenizer
        prompts, completions = generate_completions(
            self.trainer, self.prompts, tokenizer, self.generation_config, args.per_device_eval_batch_size
        )
        if self.trainer.accelerator.is_main_process:
            rows = [(str(state.global_step), p, c) for p, c in zip(prompts, completions)]
            self.table.extend(rows)
            os.makedirs(args.output_dir, exist_ok=True)
            with open(os.path.join(args.output_dir, "completions.jsonl"), "a") as f:
                for step, prompt, completion in rows:
                    f.write(json.dumps({"step": int(step), "prompt": prompt, "completion": completion}) + "\n")
            logger.info(
                "Step %d: logged %d completions to %s",
                state.global_step,
                len(rows),
                os.path.join(args.output_dir, "completions.jsonl"),
            )
            self._log_to_wandb(args)
        self._last_logged_step = state.global_step

    def _log_to_wandb(self, args) -> None:
        if "wandb" not in (args.report_to or []):
            return
        try:
            import wandb
        except ImportError:
            return
        if wandb.run is not None:
            wandb.log(
                {
                    "completions": wandb.Table(
                        columns=["step", "prompt", "completion"], data=[list(r) for r in self.table]
                    )
                }
            )
