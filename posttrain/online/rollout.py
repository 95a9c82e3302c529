"""What the online engine passes between its phases: the prompts' order, the sampled episodes and the rollout.

    RolloutSampler ──► prompts of a round ──► generate: list[Episode] ──► score ──► Rollout
        ──► policy tensors (old / reference log-probs, values) ──► advantages ──► update

An `Episode` is one completion as the generation phase produced it: a single sample, or several model turns with
tool results between them. A `Rollout` is a round's episodes as padded tensors, with named fields for everything
the later phases add; a phase returns new field values (`dataclasses.replace`) instead of filling an open dict.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, fields
from typing import Any

import torch
from torch.utils.data import DataLoader

from posttrain.data.batches import pad_rows
from posttrain.generation import derive_seed

# The columns of a prepared prompt dataset: the prompt as given, and its token ids.
PROMPT_COLUMN, PROMPT_IDS_COLUMN = "prompt", "prompt_ids"
EVAL_SEED_TAG = 1  # mixed into the eval seeds so that they differ from the training rounds'


def round_seeds(seed: int, round_index: int, slots: list[int], mode: str) -> list[int]:
    """One sampling seed per prompt of a round, from (seed, round, slot): the same round samples the same
    completions on every run and after a resume. Eval rounds ("eval" mode) have seeds of their own."""
    tag = (EVAL_SEED_TAG,) if mode == "eval" else ()
    return [derive_seed(seed, round_index, slot, *tag) for slot in slots]


__all__ = [
    "Advantages",
    "Episode",
    "Rollout",
    "RolloutSampler",
    "StreamingRolloutLoader",
    "groupwise_advantages",
    "pad_rows",
]


# -- the order in which prompts are used -------------------------------------------------------------------
class RolloutSampler:
    """For every micro-step, this process's share of the current round's prompts, tagged with the round, the
    micro-step and each prompt's position ("slot") in the round.

    Each epoch shuffles the prompts with (seed, epoch) (with shuffle=False they keep the dataset's order);
    round r of the epoch takes the next prompts_per_round of them, and process p takes the p-th contiguous block.
    A batch is repeated for every micro-step of its round, which lets the trainer find its place in the round
    (also after resuming). A dataset with fewer prompts than one round makes one round an epoch: all its prompts,
    in the epoch's order, repeated from the start to fill the round (each slot is seeded apart, so a repeated
    prompt gets other completions).
    """

    def __init__(
        self,
        num_prompts: int,
        prompts_per_round: int,
        num_processes: int,
        process_index: int,
        micro_steps_per_round: int,
        seed: int,
        shuffle: bool = True,
    ) -> None:
        self.num_prompts, self.prompts_per_round, self.shuffle = num_prompts, prompts_per_round, shuffle
        self.num_processes, self.process_index = num_processes, process_index
        self.micro_steps_per_round, self.seed = micro_steps_per_round, seed
        self.rounds_per_epoch = max(num_prompts // prompts_per_round, 1)
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return self.rounds_per_epoch * self.micro_steps_per_round

    def __iter__(self):
        for r in range(self.rounds_per_epoch):
            round_index = self.epoch * self.rounds_per_epoch + r
            tags = self.round_tags(round_index)
            for micro_step in range(self.micro_steps_per_round):
                yield [(round_index, micro_step, slot, index) for slot, index in tags]

    def round_tags(self, round_index: int, process_index: int | None = None) -> list[tuple[int, int]]:
        """This process's (or process `process_index`'s) (slot, dataset index) pairs of round `round_index`,
        counted over all epochs (the asynchronous producer looks rounds up before the loader reaches them)."""
        epoch, r = divmod(round_index, self.rounds_per_epoch)
        order = (
            torch.randperm(self.num_prompts, generator=torch.Generator().manual_seed(self.seed + epoch))
            if self.shuffle
            else torch.arange(self.num_prompts)
        )
        if self.num_prompts < self.prompts_per_round:  # a partial round, filled by repeating its prompts
            order = order.repeat(-(-self.prompts_per_round // self.num_prompts))
        local = self.prompts_per_round // self.num_processes
        process = self.process_index if process_index is None else process_index
        slots = range(process * local, (process + 1) * local)
        return list(zip(slots, order[r * self.prompts_per_round + slots.start :][:local].tolist()))


class TaggedPrompts(torch.utils.data.Dataset):
    """Looks up the rows named by RolloutSampler's tags, keeping the tags."""

    def __init__(self, dataset) -> None:
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, tag: tuple[int, int, int, int]):
        return tag, self.dataset[tag[3]]


def collate_tagged(items: list) -> dict[str, Any]:
    tags, rows = zip(*items)
    return {"round": tags[0][0], "micro_step": tags[0][1], "slots": [t[2] for t in tags], "rows": list(rows)}


class RolloutLoader(DataLoader):
    """A DataLoader whose epoch reaches the RolloutSampler (the Trainer calls set_epoch on the loader)."""

    def set_epoch(self, epoch: int) -> None:
        self.batch_sampler.set_epoch(epoch)


class _StreamRounds(torch.utils.data.IterableDataset):
    """RolloutSampler's batches for a stream (a `datasets.IterableDataset` of prepared prompts): each round takes the
    next prompts_per_round prompts in the stream's order, every process reading the stream and taking its own
    contiguous block; round indices keep counting across epochs (they seed the round's completions)."""

    def __init__(self, stream, prompts_per_round: int, num_processes: int, process_index: int, micro_steps: int):
        self.stream, self.prompts_per_round, self.micro_steps = stream, prompts_per_round, micro_steps
        local = prompts_per_round // num_processes
        self.slots = list(range(process_index * local, (process_index + 1) * local))
        self.next_round = 0

    def __iter__(self):
        rows = []
        for row in self.stream:
            rows.append(row)
            if len(rows) < self.prompts_per_round:
                continue
            mine = [rows[slot] for slot in self.slots]
            round_index, self.next_round, rows = self.next_round, self.next_round + 1, []
            for micro_step in range(self.micro_steps):
                yield {"round": round_index, "micro_step": micro_step, "slots": list(self.slots), "rows": mine}


class StreamingRolloutLoader(DataLoader):
    """The online engine's loader over a stream: no length (training needs max_steps), one batch per micro-step as
    RolloutLoader gives; a new epoch reads the stream again (a shuffled stream reshuffles with its epoch)."""

    def __init__(self, stream, prompts_per_round: int, num_processes: int, process_index: int, micro_steps: int):
        rounds = _StreamRounds(stream, prompts_per_round, num_processes, process_index, micro_steps)
        super().__init__(rounds, batch_size=None, collate_fn=_as_is)

    def set_epoch(self, epoch: int) -> None:
        if hasattr(self.dataset.stream, "set_epoch"):
            self.dataset.stream.set_epoch(epoch)


def _as_is(batch):
    return batch


# -- one sampled completion --------------------------------------------------------------------------------
@dataclass
class Episode:
    """One completion of one prompt: every token after the prompt, as the policy sampled it or as a tool's
    result was tokenized (never decoded and re-encoded).

    `model_mask[i]` is 1 where the policy sampled token i and 0 on tool-result tokens (which get no loss, no KL
    and no entropy); `logprobs` are the sampler's own log-probs (0.0 on tool tokens) when the backend reports
    them; `finished` says the last model turn ended with a stop token (else the episode was cut at
    max_completion_length); `info` holds per-episode facts for rewards and metrics (turns, tool calls, ...).
    """

    token_ids: list[int]
    model_mask: list[int]
    logprobs: list[float] | None
    finished: bool
    info: dict[str, Any] = field(default_factory=dict)
    messages: list[dict] | None = None  # the completion as chat messages, when it has tool turns
    prompt_ids: list[int] | None = None  # the episode's own prompt when not the row's (environment, rollout_func)
    reward_kwargs: dict[str, Any] = field(default_factory=dict)  # more keyword arguments for the reward functions
    vision: dict[str, torch.Tensor] | None = None  # its prompt's image inputs (online_vision.py), shared by the group

    @classmethod
    def single_turn(cls, completion) -> Episode:
        """A backend's `Completion` as a one-turn episode."""
        return cls(
            list(completion.token_ids),
            [1] * len(completion.token_ids),
            completion.logprobs,
            completion.finished_with_eos,
        )


# -- the generated batch -----------------------------------------------------------------------------------
@dataclass
class Rollout:
    """One round's episodes on this process, N = per-process generation batch, prompt-major.

    Prompts are left-padded [N, P], completions right-padded [N, T]. `completion_mask` marks every completion
    token (model and tool), `model_mask` the ones the policy sampled, `loss_mask` the ones trained on (model
    tokens, without truncated completions when those are masked). The optional fields are added by later
    phases: [N, T] tensors are aligned with the completion, advantages are [N] or [N, T].
    """

    round: int
    prompt_ids: torch.Tensor
    prompt_mask: torch.Tensor
    completion_ids: torch.Tensor
    completion_mask: torch.Tensor
    model_mask: torch.Tensor
    loss_mask: torch.Tensor
    finished: torch.Tensor  # [N] bool: ended with a stop token (else cut at max_completion_length)
    rewards: torch.Tensor  # [N], NaN where no reward function applies
    per_function_rewards: torch.Tensor  # [N, reward functions], unweighted, NaN where a function does not apply
    num_generations: int = 1  # completions per prompt (a group): num_generations, or num_generations_eval
    sampler_logps: torch.Tensor | None = None  # the sampler's own log-probs (vLLM)
    old_logps: torch.Tensor | None = None  # the policy before the update (several steps or passes per round)
    ref_logps: torch.Tensor | None = None  # the reference model (beta > 0)
    old_values: torch.Tensor | None = None  # the critic before the update (PPO)
    advantages: torch.Tensor | None = None
    returns: torch.Tensor | None = None  # the critic's targets (PPO)
    episodes: list[dict] = field(default_factory=list)  # each episode's `info`
    step_tokens: list[float] = field(default_factory=list)  # loss tokens per optimizer step, all processes
    pad_to_multiple_of: int | None = None  # batch widths are rounded up to a multiple of this
    vision: list[dict] | None = None  # per completion, its prompt's image inputs (`Episode.vision`)
    policy_version: int | None = None  # the optimizer step whose weights sampled the round

    PER_COMPLETION = (
        "completion_ids",
        "completion_mask",
        "model_mask",
        "loss_mask",
        "sampler_logps",
        "old_logps",
        "ref_logps",
        "old_values",
        "advantages",
        "returns",
    )

    def __len__(self) -> int:
        return self.completion_ids.shape[0]

    def batch(self, start: int, stop: int) -> dict[str, torch.Tensor]:
        """Rows [start, stop) with the padding columns no row of the slice needs removed."""
        rows = slice(start, stop)
        prompt_width = self._width(self.prompt_mask[rows].sum(1).max(), self.prompt_mask.shape[1])
        width = self._width(self.completion_mask[rows].sum(1).max(), self.completion_mask.shape[1])
        out = {
            "prompt_ids": self.prompt_ids[rows, -prompt_width:],
            "prompt_mask": self.prompt_mask[rows, -prompt_width:],
        }
        for name in self.PER_COMPLETION:
            value = getattr(self, name)
            if value is not None:
                out[name] = value[rows, :width] if value.dim() == 2 else value[rows]
        if self.vision is not None:  # pixel values etc., and per-token inputs over prompt + completion
            from posttrain.data.vision import vision_batch

            out.update(vision_batch(self.vision[rows], out["prompt_ids"].shape[1], out["completion_ids"].shape[1]))
        return out

    def _width(self, needed, available: int) -> int:
        multiple = self.pad_to_multiple_of or 1
        return min(-(-int(needed) // multiple) * multiple, available)

    def state(self) -> dict[str, Any]:
        """The fields as a dict (what a checkpoint stores; `Rollout(**state)` rebuilds it)."""
        return {f.name: getattr(self, f.name) for f in fields(self)}


@dataclass
class Advantages:
    """What an advantage estimator returns: the advantages, the rollout fields it also sets, and the round's
    metrics it computed on the way (logged by the engine under the round's mode)."""

    advantages: torch.Tensor
    returns: torch.Tensor | None = None
    loss_mask: torch.Tensor | None = None  # replaces the rollout's (PPO drops completions without a reward)
    metrics: dict[str, float] = field(default_factory=dict)


def groupwise_advantages(
    rewards: torch.Tensor, num_generations: int, advantage_fn: Callable[[torch.Tensor], torch.Tensor]
) -> torch.Tensor:
    """`advantage_fn(group)` for each prompt's group of rewards, over the completions some reward applies to.

    A completion whose reward is NaN (no reward function applies) gets advantage 0 and is left out of its
    group's statistics; so does every completion of a group with fewer than two scored completions.
    `advantage_fn` receives the k scored rewards of one group (1-D) and returns their k advantages.
    """
    advantages = torch.zeros_like(rewards)
    for start in range(0, rewards.numel(), num_generations):
        group = rewards[start : start + num_generations]
        scored = ~group.isnan()
        if int(scored.sum()) >= 2:
            advantages[start : start + num_generations][scored] = advantage_fn(group[scored])
    return advantages
