"""The phases of a generation round, a mixin of OnlineTrainer (engine.py): generate -> score -> build the rollout
-> policy tensors -> advantages. `make_rollout` runs them in order; every other method is a hook a method may
override (GRPO: `sample_groups` for dynamic sampling; every method: `compute_advantages`).

The rollout mode ("train", or "eval" while evaluate() generates) is an argument of every phase that depends on it,
never state of the trainer: it sets the group size (`group_size`), the seeds, where the episodes come from (the
rollout producer for training, the policy itself for evaluation) and which metrics a round writes."""

from __future__ import annotations

import dataclasses
import time

import torch

from posttrain.data.batches import pad_rows
from posttrain.data.formats import is_message_list
from posttrain.generation.vllm_backend import sampler_logps_tensor
from posttrain.models.reference import reference_forward, unwrap
from posttrain.online.rollout import (
    PROMPT_COLUMN,
    PROMPT_IDS_COLUMN,
    Advantages,
    Episode,
    Rollout,
    round_seeds,
)
from posttrain.online.vision import tokenizer_of
from posttrain.runtime.distributed import root_gathered

__all__ = ["RoundPhases", "ScoredGroups"]


@dataclasses.dataclass
class ScoredGroups:
    """Phases 1-2's result: the prompts' rows and their episodes, n per row (prompt-major), with their rewards."""

    rows: list[dict]
    episodes: list[Episode]
    prompts: list
    texts: list[str]
    rewards: torch.Tensor  # [len(rows) * n]
    per_function: torch.Tensor  # [len(rows) * n, reward functions]
    timings: dict[str, float]
    extra: dict[str, list] = dataclasses.field(default_factory=dict)  # reward functions' log_extra columns

    def groups(self, indices: list[int]) -> ScoredGroups:
        """The groups (rows) at `indices`, with their episodes."""
        n = len(self.episodes) // max(len(self.rows), 1)
        items = [g * n + k for g in indices for k in range(n)]
        rows = torch.tensor(items, dtype=torch.long)
        return ScoredGroups(
            [self.rows[g] for g in indices],
            [self.episodes[i] for i in items],
            [self.prompts[i] for i in items],
            [self.texts[i] for i in items],
            self.rewards[rows],
            self.per_function[rows],
            dict(self.timings),
            {column: [values[i] for i in items] for column, values in self.extra.items()},
        )

    @staticmethod
    def concat(parts: list[ScoredGroups]) -> ScoredGroups:
        timings: dict[str, float] = {}
        for part in parts:
            for key, value in part.timings.items():
                timings[key] = timings.get(key, 0.0) + value
        return ScoredGroups(
            sum((p.rows for p in parts), []),
            sum((p.episodes for p in parts), []),
            sum((p.prompts for p in parts), []),
            sum((p.texts for p in parts), []),
            torch.cat([p.rewards for p in parts]),
            torch.cat([p.per_function for p in parts]),
            timings,
            {
                c: sum((p.extra.get(c, [None] * len(p.prompts)) for p in parts), [])
                for c in {c for p in parts for c in p.extra}
            },
        )


class RoundPhases:
    """Makes a round's rollout from its prompts; the trainer's state (model, scorer, backend, metrics) is read
    through `self`."""

    @property
    def needs_old_logps(self) -> bool:
        """The policy changes between generation and training only with several steps or passes per round."""
        return self.args.optimizer_steps_per_generation > 1 or self.args.num_iterations > 1

    def group_size(self, mode: str) -> int:
        """Completions per prompt: num_generations in training, num_generations_eval (else the same) in "eval"."""
        args = self.args
        return args.num_generations if mode == "train" else args.num_generations_eval or args.num_generations

    def make_rollout(self, rows: list[dict], slots: list[int], round_index: int, mode: str = "train") -> Rollout:
        """Generates, scores and prepares this process's share of a round: of training, or with mode="eval" of
        evaluation (num_generations_eval completions per prompt, nothing in completions.jsonl)."""
        args, n = self.args, self.group_size(mode)
        scored = self.sample_groups(rows, n, round_seeds(args.seed, round_index, slots, mode), round_index, mode)
        rows, episodes, prompts, texts = scored.rows, scored.episodes, scored.prompts, scored.texts
        rewards, per_function = scored.rewards, scored.per_function
        if self.episode_source is not None and hasattr(self.episode_source, "tools"):
            self.record_tool_use(episodes, mode)
        rollout = self.build_rollout(round_index, rows, n, episodes, rewards, per_function)
        rollout = dataclasses.replace(rollout, **self.policy_tensors(rollout))
        estimate = self.compute_advantages(self.accelerator.gather(rollout.rewards), rollout)
        rollout = dataclasses.replace(
            rollout,
            advantages=estimate.advantages,
            returns=estimate.returns,
            loss_mask=rollout.loss_mask if estimate.loss_mask is None else estimate.loss_mask,
        )
        if mode == "train":
            rollout.step_tokens = self._step_token_totals(rollout)
        for key, value in estimate.metrics.items():
            self._metrics[mode][key].append(float(value))
        self.record_round(
            rollout,
            self.accelerator.gather(rollout.rewards),
            self.accelerator.gather(rollout.per_function_rewards),
            mode,
            scored.timings,
        )
        if args.log_completions and mode == "train":
            self.log_completions(
                prompts, texts, rewards.tolist(), per_function.tolist(), [e.messages for e in episodes], scored.extra
            )
        return rollout

    def sample_groups(self, rows: list[dict], n: int, seeds: list[int], round_index: int, mode: str) -> ScoredGroups:
        """Phases 1 and 2: `n` episodes per prompt, scored. A hook: GRPO's dynamic sampling replaces the groups
        whose rewards are all equal by generating for more prompts."""
        return self.generate_and_score(rows, n, seeds, round_index, mode)

    def generate_and_score(
        self, rows: list[dict], n: int, seeds: list[int], round_index: int, mode: str
    ) -> ScoredGroups:
        """`n` episodes per prompt, scored, every group kept: what `sample_groups` does unless a method overrides
        it, and what an override or a method's own sampling (A2PO's value estimates) builds on. Training rounds
        come from the rollout producer (producers/), evaluation's from the policy as it is."""
        start = time.perf_counter()
        with root_gathered(self.model):  # FSDP2: the sharded root's weights (distributed.py)
            episodes = (
                self.rollout_producer.episodes(round_index, rows, n, seeds)
                if mode == "train"
                else self.generate_episodes(rows, n, seeds)
            )
        generation_seconds = time.perf_counter() - start
        start = time.perf_counter()
        prompts = [row[PROMPT_COLUMN] for row in rows for _ in range(n)]
        texts, completions = self.completion_texts(prompts, episodes)
        extra: dict[str, list] = {}
        per_function, rewards = self.reward_scorer(
            prompts=prompts,
            completions=completions,
            completion_ids=[e.token_ids for e in episodes],
            columns={
                **{c: [row[c] for row in rows for _ in range(n)] for c in self.reward_columns},
                **self.episode_columns(episodes),
            },
            trainer_state=self.state,
            log_metric=lambda name, value: self._metrics[mode][name].append(float(value)),  # TRL's `log_metric`
            log_extra=extra.__setitem__,
        )
        return ScoredGroups(
            rows,
            episodes,
            prompts,
            texts,
            rewards,
            per_function,
            {"time/generation": generation_seconds, "time/scoring": time.perf_counter() - start},
            extra,
        )

    def fresh_episodes(self, rows: list[dict], n: int, seeds: list[int]) -> list[Episode]:
        """A training round sampled now (the synchronous producer): the backend takes the policy's weights (when
        vllm_sync_steps says so), then `generate_episodes`."""
        self.generation_backend.sync_weights(self.model)
        return self.generate_episodes(rows, n, seeds)

    def generate_episodes(self, rows: list[dict], n: int, seeds: list[int]) -> list[Episode]:
        """Phase 1: `n` episodes per prompt, prompt-major, sampled with the generation backend's weights (the
        synchronous producer and evaluation bring them up to date first)."""
        if self.image_prompts is not None:
            return self.image_prompts.generate(self.generation_backend, rows, n, self.sampling, seeds)
        prompt_ids = [row[PROMPT_IDS_COLUMN] for row in rows]
        if self.episode_source is not None:
            return self.episode_source.generate(rows, prompt_ids, n, self.sampling, seeds, PROMPT_COLUMN)
        return [Episode.single_turn(c) for c in self.generation_backend.generate(prompt_ids, n, self.sampling, seeds)]

    def completion_texts(self, prompts: list, episodes: list[Episode]) -> tuple[list[str], list]:
        """The decoded completions, and what the reward functions receive: the text, or for conversational
        prompts the assistant's messages."""
        texts = self.processing_class.batch_decode([e.token_ids for e in episodes], skip_special_tokens=True)
        if not is_message_list(prompts[0]):
            return texts, texts
        return texts, [e.messages or [{"role": "assistant", "content": t}] for e, t in zip(episodes, texts)]

    def episode_columns(self, episodes: list[Episode]) -> dict[str, list]:
        """Per-episode values the reward functions receive beside the dataset's columns (an environment's
        `environments`, a rollout_func's extra fields)."""
        return {key: [e.reward_kwargs[key] for e in episodes] for key in episodes[0].reward_kwargs}

    def record_tool_use(self, episodes: list[Episode], mode: str) -> None:
        """TRL's tool metrics over all processes: calls per episode, failed calls per call; and model turns per
        episode."""
        local = torch.tensor(
            [
                [
                    sum(e.info["tool_calls"] for e in episodes),
                    sum(e.info["tool_failures"] for e in episodes),
                    sum(e.info["turns"] for e in episodes),
                    len(episodes),
                ]
            ],
            dtype=torch.float64,
            device=self.accelerator.device,
        )
        calls, failures, turns, count = self.accelerator.gather(local).sum(0).tolist()
        self._metrics[mode]["tools/call_frequency"].append(calls / count)
        self._metrics[mode]["tools/failure_frequency"].append(failures / calls if calls else 0.0)
        self._metrics[mode]["tools/mean_turns"].append(turns / count)

    def build_rollout(
        self,
        round_index: int,
        rows: list[dict],
        n: int,
        episodes: list[Episode],
        rewards: torch.Tensor,
        per_function: torch.Tensor,
    ) -> Rollout:
        """Phase 2's result as padded tensors on the device."""
        device, multiple = self.accelerator.device, self.pad_multiple
        pad_id = tokenizer_of(self.processing_class).pad_token_id
        prompt_rows = [e.prompt_ids or rows[i // n][PROMPT_IDS_COLUMN] for i, e in enumerate(episodes)]
        prompt_ids, prompt_mask = pad_rows(prompt_rows, pad_id, left=True, multiple=multiple)
        completion_ids, completion_mask = pad_rows(
            [e.token_ids for e in episodes], pad_id, left=False, multiple=multiple
        )
        model_mask = pad_rows([e.model_mask for e in episodes], 0, left=False, multiple=multiple)[0]
        # a greedy sampler's log-probs (0 for its arg-max) are no distribution the loss may correct towards
        sampler_logps = None if self.args.greedy else sampler_logps_tensor(episodes, completion_ids.shape[1])
        finished = torch.tensor([e.finished for e in episodes])
        loss_mask = model_mask * finished.unsqueeze(1) if self.args.mask_truncated_completions else model_mask
        fresh = torch.tensor([not e.info.get("stale", False) for e in episodes])  # max_staleness (producers/thread.py)
        if not fresh.all():
            loss_mask = loss_mask * fresh.unsqueeze(1)
        return Rollout(
            round_index,
            prompt_ids.to(device),
            prompt_mask.to(device),
            completion_ids.to(device),
            completion_mask.to(device),
            model_mask.to(device),
            loss_mask.to(device),
            finished.to(device),
            rewards.to(device),
            per_function.to(device),
            num_generations=n,
            sampler_logps=None if sampler_logps is None else sampler_logps.to(device),
            episodes=[e.info for e in episodes],
            pad_to_multiple_of=multiple,
            policy_version=episodes[0].info.get("policy_version", self.state.global_step),
            vision=None if episodes[0].vision is None else [e.vision for e in episodes],
        )

    @property
    def pad_multiple(self) -> int | None:
        """pad_to_multiple_of resolved: 'auto' pads to 128 on Neuron (a compile per shape), else not at all."""
        multiple = self.args.pad_to_multiple_of
        if multiple == "auto":
            return 128 if self.accelerator.device.type == "neuron" else None
        return multiple

    def policy_tensors(self, rollout: Rollout) -> dict[str, torch.Tensor]:
        """Phase 3: the rollout fields computed from the models before the update: old log-probs (when the
        policy will have changed by the time a micro-batch is trained) and reference log-probs (beta > 0)."""
        out = {}
        if self.needs_old_logps:
            out["old_logps"] = self._rollout_logps(rollout, unwrap(self.model))
        if self.uses_reference:
            with reference_forward(self.model, self.ref_model) as reference:
                out["ref_logps"] = self._rollout_logps(rollout, reference)
        return out

    @torch.no_grad()
    def _rollout_logps(self, rollout: Rollout, model) -> torch.Tensor:
        """Log-probs [N, T] of all completions of the rollout, computed in micro-batches."""
        logps = torch.zeros(rollout.completion_ids.shape, device=rollout.completion_ids.device)
        size = self.args.per_device_train_batch_size
        for start in range(0, len(rollout), size):
            chunk, _ = self.completion_logps(model, rollout.batch(start, start + size))
            logps[start : start + size, : chunk.shape[1]] = chunk
        return logps

    def compute_advantages(self, rewards: torch.Tensor, rollout: Rollout) -> Advantages:
        """Phase 4, the method's estimator: advantages for this process's completions, [N] or per token [N, T].

        `rewards` [num_processes * N] are the round's rewards over all processes in prompt order (NaN where
        no reward function applies); `rollout` is this process's share, with its policy tensors.
        """
        raise NotImplementedError

    def local_share(self, values: torch.Tensor) -> torch.Tensor:
        """This process's rows of a tensor gathered over processes (in process order)."""
        size = values.shape[0] // self.accelerator.num_processes
        return values[self.accelerator.process_index * size :][:size]

    def _step_token_totals(self, rollout: Rollout) -> list[float]:
        """Loss tokens of each optimizer step of the round, summed over processes (aggregate_loss's totals); at
        least 1, so that a step with none (all dropped by max_staleness, or truncated and masked) has loss 0."""
        per_step = self.micro_batch_size * self.args.gradient_accumulation_steps
        local = rollout.loss_mask.sum(1).view(-1, per_step).sum(1).float()
        return self.accelerator.gather(local).view(-1, local.numel()).sum(0).clamp(min=1).tolist()
