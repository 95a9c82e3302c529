"""Asynchronous generation for the online engine: the next rounds are sampled while the current one trains, so
generation and the update overlap instead of alternating. This module holds the producer that samples in a
background thread of the training process (base.py `RoundsAhead` holds the schedule and the staleness bookkeeping
it shares with process.py, the one that samples in a process of its own, on its own cores).

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
import time
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from posttrain.data.batches import pad_rows
from posttrain.generation import create_generation_backend
from posttrain.models.reference import copy_model, freeze, unwrap
from posttrain.online.producers.base import ProducerContext, RoundsAhead, autocast_forward
from posttrain.online.rollout import PROMPT_IDS_COLUMN, Episode

__all__ = ["ThreadRolloutProducer"]


class ThreadRolloutProducer(RoundsAhead):
    """Generates the training rounds up to `lookahead` rounds ahead in one background thread."""

    def __init__(self, context: ProducerContext, lookahead: int) -> None:
        super().__init__(context, lookahead)
        self.sampler_model = freeze(copy_model(unwrap(context.policy)))
        self.on_server = context.args.use_vllm  # colocated vLLM is refused by the config
        if not self.on_server:  # the copy samples and scores as the trainer's forward computes (its autocast)
            autocast_forward(self.sampler_model, context.autocast_dtype)
        self.backend = (
            context.server_backend
            if self.on_server
            else create_generation_backend(self.sampler_model, context.tokenizer, context.args)
        )
        self._server_version: int | None = None  # the weights the vLLM server holds (None: unknown)
        self._executor: ThreadPoolExecutor | None = None

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

    def _submit(self, rows: list[dict], seeds: list[int]) -> Future:
        weights = None
        if self.weights_due():
            weights = {name: value.detach().clone() for name, value in unwrap(self.context.policy).state_dict().items()}
            self.version = self.latest
        if self._executor is None:
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="posttrain-rollouts")
        prompt_ids = [row[PROMPT_IDS_COLUMN] for row in rows]
        n = self.context.args.num_generations
        return self._executor.submit(self._generate, prompt_ids, n, seeds, self.version, weights)

    # -- the worker's side --------------------------------------------------------------------------------
    def _generate(self, prompt_ids, n, seeds, version, weights) -> tuple[list[Episode], float]:
        start = time.perf_counter()
        if weights is not None:
            self.sampler_model.load_state_dict(weights)
        if self.on_server and self._server_version != version:
            self.backend.sync_weights(self.sampler_model, force=True)
            self._server_version = version
        completions = self.backend.generate(prompt_ids, n, self.context.sampling, seeds)
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
        context = self.context
        pad_id, multiple = context.tokenizer.pad_token_id, context.pad_multiple
        device = next(self.sampler_model.parameters()).device
        size = context.micro_batch_size
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
            logps, _ = context.completion_logps(self.sampler_model, {k: v.to(device) for k, v in batch.items()})
            for episode, row in zip(chunk, logps.float().cpu().tolist()):
                episode.logprobs = row[: len(episode.token_ids)]

    # -- checkpoints and shutdown -------------------------------------------------------------------------
    def sampler_weights(self) -> dict[str, torch.Tensor]:
        return self.sampler_model.state_dict()

    def _load_weights(self, weights: dict[str, torch.Tensor], version: int) -> None:
        self.sampler_model.load_state_dict(weights)

    def close(self) -> None:
        """Drops the rounds still queued and stops the thread (after the generation in progress)."""
        for entry in self.rounds.values():
            if not isinstance(entry, tuple):
                entry.cancel()
        self.rounds = {}
        if self._executor is not None:
            self._executor.shutdown(wait=True, cancel_futures=True)
            self._executor = None
