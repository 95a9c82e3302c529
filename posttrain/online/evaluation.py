"""What the online engine adds around training: evaluation on an eval_dataset, round metrics in TRL's names,
and the completion log.

Evaluation generates `num_generations_eval` completions for every eval prompt with the current weights,
scores them and computes the loss on them as training would (no update); the logged keys are the
training round's metrics with the `eval_` prefix (eval_reward, eval_rewards/<name>/mean, eval_loss, ...).
Eval sampling is seeded per prompt and separately from training, so two evaluations of the same weights
see the same completions.
"""

from __future__ import annotations

import json
import math
import random
import time
from pathlib import Path

import torch
from accelerate.utils import gather_object
from datasets import Dataset
from transformers import Trainer
from transformers.trainer_utils import speed_metrics

from posttrain.callbacks.completion_table import log_completion_table, print_completion_table
from posttrain.losses.reductions import nanstd
from posttrain.online.rollout import PROMPT_IDS_COLUMN
from posttrain.training.streaming import is_prepared, is_streaming

COMPLETIONS_LOG = "completions.jsonl"


def eval_rounds(num_prompts: int, prompts_per_process: int, num_processes: int, process_index: int):
    """(indices, slots) of this process for each eval round: prompts in dataset order, each round
    prompts_per_process x num_processes of them; the last round is filled up with the first prompts again so
    that every process generates the same number of completions (their metrics count twice, as with
    accelerate's even batches)."""
    per_round = prompts_per_process * num_processes
    rounds = math.ceil(num_prompts / per_round)
    for r in range(rounds):
        slots = range(process_index * prompts_per_process, (process_index + 1) * prompts_per_process)
        yield [(r * per_round + s) % num_prompts for s in slots], list(slots)


class OnlineEvaluation:
    """Mixed into OnlineTrainer: `evaluate`, round metrics and completion logging."""

    rollout_mode = "train"  # "eval" while evaluate() generates

    # -- evaluation ------------------------------------------------------------------------------------
    def evaluate(self, eval_dataset=None, ignore_keys=None, metric_key_prefix: str = "eval") -> dict[str, float]:
        dataset = self.eval_dataset if eval_dataset is None else eval_dataset
        if isinstance(dataset, dict):  # transformers evaluates each named set through this method
            return super().evaluate(eval_dataset, ignore_keys, metric_key_prefix)
        if isinstance(dataset, str):
            dataset = self.eval_dataset[dataset]
        if is_streaming(dataset):  # rounds index the eval prompts: a stream is read whole for each evaluation
            prepared = is_prepared(dataset, PROMPT_IDS_COLUMN)
            dataset = Dataset.from_list(list(dataset))
            if not prepared:
                self.check_prompt_dataset(dataset, "eval_dataset")
                dataset = self.prepare_dataset(dataset, self.processing_class, self.args, "eval_dataset")
        elif PROMPT_IDS_COLUMN not in dataset.column_names:  # eval_dataset as given, or one handed to evaluate()
            dataset = self._prepared_eval(dataset)
        args, start = self.args, time.time()
        n = args.num_generations_eval or args.num_generations
        self._metrics["eval"].clear()
        self.generation_backend.sync_weights(self.model, force=True)
        losses = []
        was_training = self.model.training
        self.model.eval()
        self.rollout_mode = "eval"
        try:
            rounds = eval_rounds(
                len(dataset),
                args.per_device_eval_batch_size // n,
                self.accelerator.num_processes,
                self.accelerator.process_index,
            )
            for round_index, (indices, slots) in enumerate(rounds):
                rollout = self.make_rollout([dataset[i] for i in indices], slots, round_index)
                losses.append(self._eval_loss(rollout))
        finally:
            self.model.train(was_training)
            self.rollout_mode = "train"
        metrics = {
            f"{metric_key_prefix}_{key}": sum(values) / len(values)
            for key, values in self._metrics["eval"].items()
            if values
        }
        self._metrics["eval"].clear()
        metrics[f"{metric_key_prefix}_loss"] = sum(losses) / len(losses)
        metrics.update(speed_metrics(metric_key_prefix, start, num_samples=len(dataset) * n))
        Trainer.log(self, metrics)  # the engine's metrics are already in `metrics`
        self.control = self.callback_handler.on_evaluate(self.args, self.state, self.control, metrics)
        return metrics

    def _prepared_eval(self, dataset):
        """`dataset` prepared, once per dataset object: `eval_dataset` stays as given (TRL's online trainers keep
        it), so its prompts are tokenized at the first evaluation and reused at the next ones."""
        if PROMPT_IDS_COLUMN in (dataset.column_names or ()):
            return dataset
        cache = self.__dict__.setdefault("_eval_prepared", {})
        source, prepared = cache.get(id(dataset), (None, None))
        if source is not dataset:
            self.check_prompt_dataset(dataset, "eval_dataset")
            prepared = self.prepare_dataset(dataset, self.processing_class, self.args, "eval_dataset")
            cache[id(dataset)] = (dataset, prepared)  # the source is kept so that its id is not reused
        return prepared

    @torch.no_grad()
    def _eval_loss(self, rollout) -> float:
        """The training loss on an eval rollout, over all of it (all processes' mean)."""
        batch = rollout.batch(0, len(rollout))
        batch["total_sequences"] = len(rollout) * self.accelerator.num_processes
        batch["total_tokens"] = float(self.accelerator.gather(rollout.loss_mask.sum().float().reshape(1)).sum())
        with self.compute_loss_context_manager():
            loss = self.compute_loss(self.model, batch)
        # compute_loss returns this process's share of a sum over processes (DDP averages gradients).
        return float(self.accelerator.gather((loss / self.accelerator.num_processes).detach().reshape(1)).sum())

    # -- metrics -----------------------------------------------------------------------------------------
    def record_round(
        self, rollout, rewards: torch.Tensor, per_function: torch.Tensor, mode: str, timings: dict[str, float]
    ) -> None:
        """A round's metrics over all processes under TRL's names (the gathered tensors are the same on every
        process), plus posttrain's own (reward function timings, advantages)."""
        gather = self.accelerator.gather
        lengths = gather(rollout.model_mask.sum(1)).float()  # the model's tokens (not tool results)
        prompt_lengths = gather(rollout.prompt_mask.sum(1)).float()
        if mode == "train":
            self.state.num_input_tokens_seen += int(prompt_lengths.sum() + lengths.sum())
        self._metrics[mode]["num_tokens"] = [self.state.num_input_tokens_seen]
        advantages = gather(rollout.advantages)
        if advantages.dim() == 2:  # per-token advantages: statistics over the trained tokens
            advantages = advantages[gather(rollout.loss_mask).bool()]
        groups = rewards.view(-1, rollout.num_generations)
        zero_std = [bool(nanstd(group) == 0) for group in groups]
        clipped = ~gather(rollout.finished)
        terminated = lengths[~clipped] if bool((~clipped).any()) else torch.zeros(1)
        metrics = {
            "completions/mean_length": lengths.mean(),
            "completions/min_length": lengths.min(),
            "completions/max_length": lengths.max(),
            "completions/clipped_ratio": clipped.float().mean(),
            "completions/mean_terminated_length": terminated.mean(),
            "completions/min_terminated_length": terminated.min(),
            "completions/max_terminated_length": terminated.max(),
        }
        for i, name in enumerate(self.reward_scorer.names):
            metrics[f"rewards/{name}/mean"] = per_function[:, i].nanmean()
            metrics[f"rewards/{name}/std"] = nanstd(per_function[:, i])
        if self.reward_scorer.failure_policy == "skip":  # failed calls this round, summed over processes
            faults = self.reward_scorer.pop_faults()
            counts = gather(torch.tensor([list(faults.values())], dtype=torch.float32, device=rewards.device))
            for name, count in zip(faults, counts.sum(0).tolist()):
                metrics[f"rewards/{name}/failures"] = count
        events = self.generation_backend.pop_metrics()  # e.g. vllm/reconnects: server losses recovered from
        if events:  # max over processes: one outage seen by every process counts once
            counts = gather(torch.tensor([list(events.values())], dtype=torch.float32, device=rewards.device))
            metrics.update(zip(events, counts.max(0).values.tolist()))
        metrics.update(
            {
                "reward": rewards.nanmean(),
                "reward_std": nanstd(rewards),
                "frac_reward_zero_std": sum(zero_std) / len(zero_std),
                "frac_reward_none": rewards.isnan().float().mean(),
                "advantages/mean": advantages.mean(),
                "advantages/std": nanstd(advantages),
                **timings,
            }
        )
        for key, value in metrics.items():
            self._metrics[mode][key].append(float(value))

    # -- completions ---------------------------------------------------------------------------------------
    def log_completions(
        self,
        prompts: list,
        texts: list[str],
        rewards: list[float],
        per_function: list[list[float]] | None = None,
        transcripts: list[list[dict] | None] | None = None,
        extra: dict[str, list] | None = None,
    ) -> None:
        """Appends the round's completions (all processes) to output_dir/completions.jsonl, with the total reward
        and each reward function's, and keeps them for the console print at the next log. An episode with tool
        turns also keeps its `transcript` (its messages: the tool calls and results), which the table and the
        run report show with the calls and results marked; its decoded text alone has lost the turns' roles. `extra`
        holds the columns reward functions gave through `log_extra`, one value per completion."""
        names = self.reward_scorer.names
        records = []
        for i, (prompt, text, reward) in enumerate(zip(prompts, texts, rewards)):
            record = {
                "step": self.state.global_step,
                "prompt": prompt,
                "completion": text,
                "reward": None if math.isnan(reward) else reward,
            }
            if per_function is not None:
                record["rewards"] = {name: None if math.isnan(v) else v for name, v in zip(names, per_function[i])}
            if transcripts is not None and transcripts[i]:
                record["transcript"] = transcripts[i]
            if extra:
                record["extra"] = {column: values[i] for column, values in extra.items()}
            records.append(record)
        records = gather_object(records)
        if self.accelerator.is_main_process:
            path = Path(self.args.output_dir) / COMPLETIONS_LOG
            path.parent.mkdir(parents=True, exist_ok=True)
            with path.open("a", encoding="utf-8") as file:
                file.writelines(json.dumps(record, ensure_ascii=False) + "\n" for record in records)
            self._pending_completions.extend(records)

    def completions_to_print(self) -> list[dict]:
        """The window's completions to print: each prompt once with log_unique_prompts, then at most
        num_completions_to_print of them drawn at random (seeded by the step)."""
        records, self._pending_completions = self._pending_completions, []
        if self.args.log_unique_prompts:
            seen: set[str] = set()
            records = [r for r in records if not (str(r["prompt"]) in seen or seen.add(str(r["prompt"])))]
        limit = self.args.num_completions_to_print
        if limit is not None and len(records) > limit:
            records = random.Random(self.state.global_step).sample(records, limit)
        return records

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        super().log(logs, start_time)
        if self.args.log_completions and self.accelerator.is_main_process and self._pending_completions:
            records, names, step = self.completions_to_print(), self.reward_scorer.names, self.state.global_step
            print_completion_table(records, names, step)
            log_completion_table(self.callback_handler.callbacks, records, names, step)
