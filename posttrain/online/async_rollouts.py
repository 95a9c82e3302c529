"""Asynchronous generation for the online engine: a background thread samples the next rounds while the current
one trains, so generation and the update overlap instead of alternating.

Schedule. With k = OnlineConfig.async_generation_rounds, when round r starts training the producer makes sure
that rounds r .. r+k are submitted. A round is sampled with the weights the policy has when it is submitted, so
round r is sampled with the weights of the start of round max(r - k, 0): at most k rounds stale. k = 0 samples
each round with its own weights, the synchronous schedule (through the same thread, copy and correction).

Weights. The sampler is a copy of the policy: the transformers backend generates with it; with a vLLM server its
weights are what the server receives. A submitted round carries a clone of the weights it must be sampled with
(refreshed when the last clone is at least vllm_sync_steps optimizer steps old, else the sampler keeps the older
weights), and the worker loads them just before generating, so training never waits for a generation in
progress.

Off-policy correction. Every episode records the optimizer step of its weights (`info["policy_version"]`) and the
sampler's log-probs of its tokens (reported by vLLM; with the transformers backend computed by the worker with
the copy, through the trainer's own forward). The engine's sampler correction (vllm_importance_sampling_*) then
weights the loss by pi_old / pi_sampler, pi_old being the policy when the round starts training.

Resume. A checkpoint waits for the rounds in flight and stores their episodes (and the sampler's weights when
they may be reused), so a resumed run trains on exactly the rounds the uninterrupted run trains on.
"""

from __future__ import annotations

import contextlib
import math
import time
from concurrent.futures import Future, ThreadPoolExecutor

import torch
from transformers import TrainerCallback

from posttrain.errors import ConfigError
from posttrain.generation import create_generation_backend
from posttrain.models.reference import copy_model, freeze, unwrap
from posttrain.online.rollout import PROMPT_IDS_COLUMN, Episode, pad_rows, round_seeds
from posttrain.online.vision import tokenizer_of

__all__ = ["AsyncRolloutProducer", "check_async_support"]


def check_async_support(trainer) -> None:
    """Stops before training when a setting of `trainer` generates in a way the producer cannot take over."""
    method = type(trainer)
    unsupported = {
        f"{method.__name__}'s loss, which does not read the sampler's log-probs (stale samples would train "
        "uncorrected)": not (method.loss_reads_sampler_logps or method.loss_ignores_the_sampler),
        "tools, environment_factory or rollout_func (multi-turn episodes)": trainer.episode_source is not None,
        "image prompts": trainer.image_prompts is not None,
        f"{method.__name__}'s own generation (generate_episodes)": method.own_generation,
        "dynamic_sampling (it regenerates inside a round with the current policy)": getattr(
            trainer.args, "dynamic_sampling", False
        ),
        "several processes (the generation thread would run collectives beside training's)": (
            trainer.accelerator.num_processes > 1
        ),
    }
    name = "max_staleness" if hasattr(trainer.args, "max_staleness") else "async_generation_rounds"
    fix = (
        "use the synchronous trainer"
        if name == "max_staleness"
        else "set async_generation_rounds=None (synchronous generation)"
    )
    for what, present in unsupported.items():
        if present:
            raise ConfigError(
                f"{name}={getattr(trainer.args, name)} generates in a background thread, which does not "
                f"support {what} yet; {fix} or drop that setting."
            )


class AsyncRolloutProducer:
    """Generates the training rounds of `trainer` up to `lookahead` rounds ahead in one background thread."""

    def __init__(self, trainer, lookahead: int, sync_steps: int) -> None:
        check_async_support(trainer)
        self.trainer, self.lookahead, self.sync_steps = trainer, lookahead, sync_steps
        self.sampler_model = freeze(copy_model(unwrap(trainer.model)))
        self.on_server = trainer.args.use_vllm  # colocated vLLM is refused by the config
        self.backend = (
            trainer.generation_backend
            if self.on_server
            else create_generation_backend(self.sampler_model, tokenizer_of(trainer.processing_class), trainer.args)
        )
        self.rounds: dict[int, Future | tuple[list[Episode], float]] = {}
        self.version: int | None = None  # the optimizer step of the weights the last submitted round uses
        self._server_version: int | None = None  # the weights the vLLM server holds (None: unknown)
        self._executor: ThreadPoolExecutor | None = None
        trainer.add_callback(_CloseAtTrainEnd(self))

    # -- the engine's side --------------------------------------------------------------------------------
    def episodes(self, round_index: int, rows: list[dict], n: int, seeds: list[int]) -> list[Episode]:
        """Round `round_index`'s episodes, once the rounds up to `lookahead` ahead are submitted; logs the
        round's staleness (optimizer steps between its weights and the policy's) and how long training waited."""
        self._submit_ahead(round_index, rows, seeds)
        start = time.perf_counter()
        entry = self.rounds.pop(round_index)
        episodes, seconds = entry.result() if isinstance(entry, Future) else entry
        prompts = [row[PROMPT_IDS_COLUMN] for row in rows for _ in range(n)]
        if len(episodes) != len(prompts) or any(e.prompt_ids != p for e, p in zip(episodes, prompts)):
            raise RuntimeError(
                f"Round {round_index} was generated for other prompts than the ones it trains on "
                "(the prompt order changed after the rounds ahead were submitted)."
            )
        metrics = self.trainer._metrics["train"]
        metrics["sample/staleness_mean"].append(
            float(self.trainer.state.global_step - episodes[0].info["policy_version"])
        )
        metrics["perf/rollout_wait_s"].append(time.perf_counter() - start)
        metrics["time/async_generation"].append(seconds)
        return episodes

    @contextlib.contextmanager
    def paused(self):
        """With a vLLM server, no generation runs inside (evaluation pushes the policy's weights to the server and
        samples there) and the next round pushes its weights again. The transformers backend's copy is apart
        from the policy, so its rounds go on generating."""
        for entry in list(self.rounds.values()) if self.on_server else []:
            if isinstance(entry, Future):
                entry.exception()  # waits; a failure is raised when the round is taken
        try:
            yield
        finally:
            self._server_version = None

    def _submit_ahead(self, round_index: int, rows: list[dict], seeds: list[int]) -> None:
        trainer = self.trainer
        steps_per_round = trainer.args.steps_per_generation * trainer.args.num_iterations
        last_round = math.ceil(trainer.state.max_steps / steps_per_round) - 1
        for ahead in range(round_index, min(round_index + self.lookahead, last_round) + 1):
            if ahead in self.rounds:
                continue
            if ahead == round_index:
                ahead_rows, ahead_seeds = rows, seeds
            else:
                tags = trainer.rollout_sampler.round_tags(ahead)
                ahead_rows = [trainer.train_dataset[index] for _, index in tags]
                ahead_seeds = round_seeds(trainer.args.seed, ahead, [slot for slot, _ in tags], "train")
            self.rounds[ahead] = self._submit(ahead_rows, ahead_seeds)
        if round_index not in self.rounds:  # the round after the last one (a shorter max_steps on resume)
            self.rounds[round_index] = self._submit(rows, seeds)

    def _submit(self, rows: list[dict], seeds: list[int]) -> Future:
        step = self.trainer.state.global_step
        weights = None
        if self.version is None or step - self.version >= self.sync_steps:
            weights = {name: value.detach().clone() for name, value in unwrap(self.trainer.model).state_dict().items()}
            self.version = step
        if self._executor is None:
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="posttrain-rollouts")
        prompt_ids = [row[PROMPT_IDS_COLUMN] for row in rows]
        return self._executor.submit(
            self._generate, prompt_ids, self.trainer.args.num_generations, seeds, self.version, weights
        )

    # -- the worker's side --------------------------------------------------------------------------------
    def _generate(self, prompt_ids, n, seeds, version, weights) -> tuple[list[Episode], float]:
        start = time.perf_counter()
        if weights is not None:
            self.sampler_model.load_state_dict(weights)
        if self.on_server and self._server_version != version:
            self.backend.sync_weights(self.sampler_model, force=True)
            self._server_version = version
        completions = self.backend.generate(prompt_ids, n, self.trainer.sampling, seeds)
        episodes = [Episode.single_turn(c) for c in completions]
        for episode, completion in zip(episodes, completions):
            episode.prompt_ids = list(prompt_ids[completion.prompt_index])
            episode.info["policy_version"] = version
        if any(e.logprobs is None for e in episodes):
            self._sampler_logps(episodes)
        return episodes, time.perf_counter() - start

    @torch.no_grad()
    def _sampler_logps(self, episodes: list[Episode]) -> None:
        """Each episode's log-probs under the sampler's weights, computed as the trainer computes its own (the
        trainer's forward and temperature, the same micro-batches), so that with unchanged weights they agree
        exactly."""
        trainer = self.trainer
        pad_id, multiple = tokenizer_of(trainer.processing_class).pad_token_id, trainer.pad_multiple
        device = next(self.sampler_model.parameters()).device
        size = trainer.micro_batch_size
        for start in range(0, len(episodes), size):
            chunk = episodes[start : start + size]
            prompt_ids, prompt_mask = pad_rows([e.prompt_ids for e in chunk], pad_id, left=True, multiple=multiple)
            ids, mask = pad_rows([e.token_ids for e in chunk], pad_id, left=False, multiple=multiple)
            batch = {
                "prompt_ids": prompt_ids,
                "prompt_mask": prompt_mask,
                "completion_ids": ids,
                "completion_mask": mask,
            }
            logps, _ = trainer.completion_logps(self.sampler_model, {k: v.to(device) for k, v in batch.items()})
            for episode, row in zip(chunk, logps.float().cpu().tolist()):
                episode.logprobs = row[: len(episode.token_ids)]

    # -- checkpoints and shutdown -------------------------------------------------------------------------
    def state(self) -> dict:
        """The rounds submitted and not yet trained on (waiting for those in flight), the sampler's version and,
        when a later round may reuse them (vllm_sync_steps > 1), its weights."""
        rounds = {index: entry.result() if isinstance(entry, Future) else entry for index, entry in self.rounds.items()}
        self.rounds.update(rounds)
        weights = None
        if self.sync_steps > 1 and self.version is not None:
            weights = {name: value.detach().clone() for name, value in self.sampler_model.state_dict().items()}
        return {"rounds": rounds, "version": self.version, "weights": weights}

    def load_state(self, state: dict) -> None:
        self.close()
        self.rounds = dict(state["rounds"])
        self.version = state["version"]
        if state["weights"] is not None:
            self.sampler_model.load_state_dict(state["weights"])

    def close(self) -> None:
        """Drops the rounds still queued and stops the thread (after the generation in progress)."""
        for entry in self.rounds.values():
            if isinstance(entry, Future):
                entry.cancel()
        self.rounds = {}
        if self._executor is not None:
            self._executor.shutdown(wait=True, cancel_futures=True)
            self._executor = None


class _CloseAtTrainEnd(TrainerCallback):
    def __init__(self, producer: AsyncRolloutProducer) -> None:
        self.producer = producer

    def on_train_end(self, args, state, control, **kwargs):
        self.producer.close()
