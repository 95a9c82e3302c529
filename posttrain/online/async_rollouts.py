"""Asynchronous generation for the online engine: the next rounds are sampled while the current one trains, so
generation and the update overlap instead of alternating. This module holds the schedule, the staleness
bookkeeping and the producer that samples in a background thread of the training process; process_rollouts.py
holds the one that samples in a process of its own, on its own cores (the default on a CPU machine with free
cores), and chooses between them.

Schedule. With k = OnlineConfig.async_generation_rounds, when round r starts training the producer makes sure
that rounds r .. r+k are submitted. A round is sampled with the weights the policy has when it is submitted, so
round r is sampled with the weights of the start of round max(r - k, 0): at most k rounds stale (a generation
process's in-flight updates make the later tokens of a round fresher). k = 0 samples each round with its own
weights, the synchronous schedule (through the same thread, copy and correction).

Weights. The sampler is a copy of the policy: the transformers backend generates with it; with a vLLM server its
weights are what the server receives. A submitted round carries a clone of the weights it must be sampled with
(refreshed when the last clone is at least vllm_sync_steps optimizer steps old, else the sampler keeps the older
weights), and the worker loads them just before generating, so training never waits for a generation in
progress.

Off-policy correction. Every token records the optimizer step of the weights that sampled it
(`info["token_versions"]`; `info["policy_version"]` is the episode's oldest) and every episode the sampler's
log-probs of its tokens, each under its own token's weights (reported by vLLM; with the transformers backend
computed by the worker through the trainer's own forward, or taken from the decode loop when in-flight updates
changed the weights inside a round). The engine's sampler correction (vllm_importance_sampling_*) then weights the
loss by pi_old / pi_sampler token by token, pi_old being the policy when the round starts training. With
max_staleness, an episode whose oldest token is more than that many optimizer steps older than the policy when
its round starts training is dropped from the loss (its group still counts for the advantages);
sample/staleness_mean and /staleness_max (over tokens) and sample/dropped_stale (episodes) are logged.

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
    name = "max_staleness" if hasattr(trainer.args, "resolve_async_pipeline") else "async_generation_rounds"
    fix = (
        "use the synchronous trainer"
        if name == "max_staleness"
        else "set async_generation_rounds=None (synchronous generation)"
    )
    for what, present in unsupported.items():
        if present:
            raise ConfigError(
                f"{name}={getattr(trainer.args, name)} generates ahead of training, which does not "
                f"support {what} yet; {fix} or drop that setting."
            )


class AsyncRolloutProducer:
    """Generates the training rounds of `trainer` up to `lookahead` rounds ahead in one background thread."""

    def __init__(self, trainer, lookahead: int, sync_steps: int) -> None:
        check_async_support(trainer)
        self.trainer, self.lookahead, self.sync_steps = trainer, lookahead, sync_steps
        self.sampler_model = freeze(copy_model(unwrap(trainer.model)))
        # A round is pending (it has `result()`) or done: (its episodes, its generation seconds).
        self.rounds: dict[int, Future | tuple[list[Episode], float]] = {}
        self.version: int | None = None  # the optimizer step of the weights the last submitted round uses
        self.setup_sampler()
        trainer.add_callback(_ProducerEvents(self))

    def setup_sampler(self) -> None:
        """The thread's sampler: the copy with its own backend, or the vLLM server."""
        trainer = self.trainer
        self.on_server = trainer.args.use_vllm  # colocated vLLM is refused by the config
        self.backend = (
            trainer.generation_backend
            if self.on_server
            else create_generation_backend(self.sampler_model, tokenizer_of(trainer.processing_class), trainer.args)
        )
        self._server_version: int | None = None  # the weights the vLLM server holds (None: unknown)
        self._executor: ThreadPoolExecutor | None = None

    # -- the engine's side --------------------------------------------------------------------------------
    def episodes(self, round_index: int, rows: list[dict], n: int, seeds: list[int]) -> list[Episode]:
        """Round `round_index`'s episodes, once the rounds up to `lookahead` ahead are submitted; logs the
        round's staleness (optimizer steps between its weights and the policy's) and how long training waited."""
        self._submit_ahead(round_index, rows, seeds)
        start = time.perf_counter()
        entry = self.rounds.pop(round_index)
        episodes, seconds = entry if isinstance(entry, tuple) else entry.result()
        prompts = [row[PROMPT_IDS_COLUMN] for row in rows for _ in range(n)]
        if len(episodes) != len(prompts) or any(e.prompt_ids != p for e, p in zip(episodes, prompts)):
            raise RuntimeError(
                f"Round {round_index} was generated for other prompts than the ones it trains on "
                "(the prompt order changed after the rounds ahead were submitted)."
            )
        metrics = self.trainer._metrics["train"]
        self.record_staleness(episodes, metrics)
        metrics["perf/rollout_wait_s"].append(time.perf_counter() - start)
        metrics["time/async_generation"].append(seconds)
        return episodes

    def record_staleness(self, episodes: list[Episode], metrics) -> None:
        """Logs the tokens' staleness (optimizer steps between the weights that sampled them and the policy now)
        and marks the episodes older than max_staleness, which the engine leaves out of the loss."""
        step, limit = self.trainer.state.global_step, self.trainer.args.max_staleness
        ages, dropped = [], 0
        for episode in episodes:
            oldest = step - episode.info["policy_version"]
            ages += [step - version for version in episode.info["token_versions"]] or [oldest]
            if limit is not None and oldest > limit:
                episode.info["stale"] = True
                dropped += 1
        metrics["sample/staleness_mean"].append(sum(ages) / len(ages))
        metrics["sample/staleness_max"].append(float(max(ages)))
        metrics["sample/dropped_stale"].append(float(dropped))

    def after_step(self, step: int) -> None:
        """Called after every optimizer step (a generation process publishes new weights here)."""

    def update_phase(self, model):
        """A context for the update's forward and backward (a generation process lends its idle cores there)."""
        return contextlib.nullcontext()

    @contextlib.contextmanager
    def paused(self):
        """With a vLLM server, no generation runs inside (evaluation pushes the policy's weights to the server and
        samples there) and the next round pushes its weights again. The transformers backend's copy is apart
        from the policy, so its rounds go on generating."""
        for entry in list(self.rounds.values()) if self.on_server else []:
            if not isinstance(entry, tuple):
                entry.exception()  # waits; a failure is raised when the round is taken
        try:
            yield
        finally:
            self._server_version = None

    def _submit_ahead(self, round_index: int, rows: list[dict], seeds: list[int]) -> None:
        trainer = self.trainer
        steps_per_round = trainer.args.optimizer_steps_per_generation * trainer.args.num_iterations
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
            episode.info["token_versions"] = [version] * len(episode.token_ids)
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
        rounds = {index: entry if isinstance(entry, tuple) else entry.result() for index, entry in self.rounds.items()}
        self.rounds.update(rounds)
        weights = None
        if self.sync_steps > 1 and self.version is not None:
            weights = {name: value.detach().clone() for name, value in self.sampler_weights().items()}
        return {"rounds": rounds, "version": self.version, "weights": weights}

    def sampler_weights(self) -> dict[str, torch.Tensor]:
        """The weights the sampler holds for `self.version` (saved when a later round may reuse them)."""
        return self.sampler_model.state_dict()

    def load_state(self, state: dict) -> None:
        self.close()
        self.rounds = dict(state["rounds"])
        self.version = state["version"]
        if state["weights"] is not None:
            self.sampler_model.load_state_dict(state["weights"])

    def close(self) -> None:
        """Drops the rounds still queued and stops the thread (after the generation in progress)."""
        for entry in self.rounds.values():
            if not isinstance(entry, tuple):
                entry.cancel()
        self.rounds = {}
        if self._executor is not None:
            self._executor.shutdown(wait=True, cancel_futures=True)
            self._executor = None


class _ProducerEvents(TrainerCallback):
    def __init__(self, producer: AsyncRolloutProducer) -> None:
        self.producer = producer

    def on_step_end(self, args, state, control, **kwargs):
        self.producer.after_step(state.global_step)

    def on_train_end(self, args, state, control, **kwargs):
        self.producer.close()
