"""The rollout producer's interface and what it is given (the package's docstring describes both): `ProducerContext`,
`RolloutProducer`, and `RoundsAhead`, the schedule of the producers that generate rounds ahead of training.

Implementations import from this module, not from the package (whose `__init__` imports them to choose one)."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from accelerate.utils import convert_outputs_to_fp32, get_mixed_precision_context_manager
from torch import nn

from posttrain.generation import SamplingParams
from posttrain.online.config import OnlineConfig
from posttrain.online.rollout import PROMPT_IDS_COLUMN, Episode

__all__ = ["ProducerContext", "RolloutProducer", "RoundsAhead", "autocast_dtype", "autocast_forward"]


@dataclass(frozen=True)
class ProducerContext:
    """What a producer may use of the trainer, and nothing else."""

    args: OnlineConfig  # the run's settings (num_generations, async_*, vllm_sync_steps, max_staleness, backend)
    policy: nn.Module  # the trained model (maybe wrapped); a pushed version is its weights at that moment
    tokenizer: Any  # the text tokenizer (pad and stop tokens)
    sampling: SamplingParams
    micro_batch_size: int  # completions per forward when the sampler's log-probs are recomputed
    pad_multiple: int | None
    logps_temperature: float
    device: torch.device  # where training runs
    # Synchronous generation with the policy's current weights: (rows, n, seeds) -> n episodes per row.
    generate: Callable[[list[dict], int, list[int]], list[Episode]]
    # The trainer's log-probs of a padded batch under a model: (model, batch) -> (logps [B, T], entropies).
    completion_logps: Callable[[nn.Module, dict], tuple[torch.Tensor, Any]]
    # A training round's prompt rows and seeds by its index; None past the run's last round.
    round_source: Callable[[int], tuple[list[dict], list[int]] | None]
    log_metric: Callable[[str, float], None]  # a training metric of the current logging window
    server_backend: Any = None  # the trainer's own generation backend (with use_vllm, the server's client)
    # What the trainer does that a producer generating ahead cannot take over (each names the setting).
    unsupported: tuple[str, ...] = ()
    # With several training processes: every process's rows and seeds of a round, in process order (rank 0 of
    # the Ray producer routes whole rounds, producers/ray_ranks.py); None past the last round.
    every_round_source: Callable[[int], tuple[list[dict], list[int]] | None] | None = None
    # The dtype of the autocast the trainer's forward runs under (bf16 / fp16 mixed precision; None: float32).
    # A sampler with its own copy of the policy runs its forward the same way (`autocast_forward`).
    autocast_dtype: torch.dtype | None = None


def autocast_dtype(accelerator) -> torch.dtype | None:
    """The dtype of the autocast that `accelerator.prepare` wraps the model's forward in; None without one."""
    context = get_mixed_precision_context_manager(accelerator.native_amp, accelerator.autocast_handler)
    enabled = isinstance(context, torch.autocast) and getattr(context, "_enabled", True)
    return context.fast_dtype if enabled else None


def autocast_forward(model: nn.Module, dtype: torch.dtype | None) -> nn.Module:
    """`model` with its forward wrapped as accelerate wraps the trainer's (autocast to `dtype` on the device of its
    parameters, outputs cast back to float32), so that a sampler's copy computes the trainer's numbers: its tokens
    and log-probs. The parameters stay float32; autocast changes the compute only. None: `model` unchanged."""
    if dtype is not None:
        device_type = next(model.parameters()).device.type
        model.forward = convert_outputs_to_fp32(torch.autocast(device_type, dtype=dtype)(model.forward))
    return model


class RolloutProducer:
    """The engine's one way to get a training round's episodes (see the package docstring)."""

    generates_ahead: ClassVar[bool] = True  # whether rounds are sampled before the round that trains on them

    def __init__(self, context: ProducerContext) -> None:
        self.context = context

    def start(self) -> None:
        """Training starts (before the first round is asked for)."""

    def episodes(self, round_index: int, rows: list[dict], n: int, seeds: list[int]) -> list[Episode]:
        """Round `round_index`'s `n` episodes per row of `rows` (prompt-major), sampled with `seeds`."""
        raise NotImplementedError

    def push_weights(self, version: int) -> None:
        """The policy now holds the weights of optimizer step `version` (at the start and after every step)."""

    def update_phase(self, model):
        """A context around the update's forward and backward."""
        return contextlib.nullcontext()

    def paused(self):
        """A context in which evaluation generates with the policy's own weights."""
        return contextlib.nullcontext()

    def state(self) -> dict | None:
        """What a checkpoint stores so that a resumed run trains on the same rounds (None: nothing)."""
        return None

    def load_state(self, state: dict) -> None:
        """Takes back `state()` from a checkpoint."""

    def close(self) -> None:
        """Training ends: stop generating and give back what was taken (threads, processes, cores)."""


class RoundsAhead(RolloutProducer):
    """The schedule of a producer that generates up to `lookahead` rounds ahead (thread.py describes it): submitted
    rounds, the version of the weights the last one used, their staleness when taken. A subclass samples (`_submit`
    returns the round's pending result) and holds the sampler's weights (`sampler_weights`, `_load_weights`)."""

    def __init__(self, context: ProducerContext, lookahead: int) -> None:
        super().__init__(context)
        self.lookahead, self.sync_steps = lookahead, context.args.vllm_sync_steps
        # A round is pending (it has `result()`) or done: (its episodes, its generation seconds).
        self.rounds: dict[int, Any] = {}
        self.version: int | None = None  # the optimizer step of the weights the last submitted round uses
        self.latest = 0  # the newest version pushed: the policy's optimizer step

    def push_weights(self, version: int) -> None:
        self.latest = version

    def weights_due(self) -> bool:
        """Whether the next round takes the policy's weights (the last ones are vllm_sync_steps old or more)."""
        return self.version is None or self.latest - self.version >= self.sync_steps

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
        self.record_staleness(episodes)
        self.context.log_metric("perf/rollout_wait_s", time.perf_counter() - start)
        self.context.log_metric("time/async_generation", seconds)
        return episodes

    def record_staleness(self, episodes: list[Episode]) -> None:
        """Logs the tokens' staleness (optimizer steps between the weights that sampled them and the policy now)
        and marks the episodes older than max_staleness, which the engine leaves out of the loss."""
        step, limit = self.latest, self.context.args.max_staleness
        ages, dropped = [], 0
        for episode in episodes:
            oldest = step - episode.info["policy_version"]
            ages += [step - version for version in episode.info["token_versions"]] or [oldest]
            if limit is not None and oldest > limit:
                episode.info["stale"] = True
                dropped += 1
        self.context.log_metric("sample/staleness_mean", sum(ages) / len(ages))
        self.context.log_metric("sample/staleness_max", float(max(ages)))
        self.context.log_metric("sample/dropped_stale", float(dropped))

    def _submit_ahead(self, round_index: int, rows: list[dict], seeds: list[int]) -> None:
        for ahead in range(round_index, round_index + self.lookahead + 1):
            if ahead in self.rounds:
                continue
            source = (rows, seeds) if ahead == round_index else self.context.round_source(ahead)
            if source is None:  # past the run's last round
                break
            self.rounds[ahead] = self._submit(*source)

    def _submit(self, rows: list[dict], seeds: list[int]):
        raise NotImplementedError

    # -- checkpoints --------------------------------------------------------------------------------------
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
        """The sampler's state dict for `self.version` (the same keys for every producer, so that either resumes
        from the other's checkpoint)."""
        raise NotImplementedError

    def load_state(self, state: dict) -> None:
        self.close()
        self.rounds = dict(state["rounds"])
        if state["weights"] is not None:
            self._load_weights(state["weights"], state["version"])
        self.version = state["version"]

    def _load_weights(self, weights: dict[str, torch.Tensor], version: int) -> None:
        raise NotImplementedError
