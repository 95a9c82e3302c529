"""GRPO with a replay buffer, at the import path older TRL releases had (`trl.experimental.grpo_with_replay_buffer`,
removed in 2026): groups whose rewards all agree teach nothing (zero advantage), so each is replaced by a group
from earlier rounds that did have reward variance.

After a round's advantages are computed, its groups with variance enter a buffer of at most replay_buffer_size
groups scored by std(rewards) * sum |advantages| (a full buffer evicts its lowest score for a higher one); each
zero-variance group of the round is then swapped for a buffered group drawn with probability proportional to
its score, with the advantages it had when it was generated. Every group keeps the log-probs of the policy that
generated it as its old log-probs, so a replayed group's ratio pi / pi_old is clipped like any off-policy sample
(this trainer always computes old log-probs; TRL's used them only when it had them). The buffer is per process,
saved in checkpoints, and sampled with a seeded generator, so a resumed run replays the same groups.
"""

from __future__ import annotations

import heapq
import itertools

import torch

from posttrain.errors import ConfigError
from posttrain.experimental.grpo_with_replay_buffer.grpo_with_replay_buffer_config import GRPOWithReplayBufferConfig
from posttrain.generation.base import derive_seed
from posttrain.online.rollout import Rollout
from posttrain.trainers.grpo import GRPOTrainer, group_has_variance

__all__ = ["GRPOWithReplayBufferConfig", "GRPOWithReplayBufferTrainer", "ReplayBuffer"]

_REPLAY_TAG = 7  # keeps the buffer's sampling seeds apart from the others derived from (seed, round)


class ReplayBuffer:
    """The `max_size` highest-scored groups seen so far; `sample` draws with probability proportional to score."""

    def __init__(self, max_size: int) -> None:
        self.max_size = max_size
        self.heap: list[tuple[float, int, dict]] = []  # a min-heap: the lowest score is evicted first
        self._counter = itertools.count()

    def __len__(self) -> int:
        return len(self.heap)

    def add(self, score: float, group: dict) -> None:
        entry = (score, next(self._counter), group)
        if len(self.heap) < self.max_size:
            heapq.heappush(self.heap, entry)
        elif self.heap and score > self.heap[0][0]:
            heapq.heapreplace(self.heap, entry)

    def sample(self, count: int, generator: torch.Generator) -> list[dict]:
        scores = torch.tensor([entry[0] for entry in self.heap], dtype=torch.float64).clamp(min=1e-12)
        chosen = torch.multinomial(scores, count, replacement=count > len(self.heap), generator=generator)
        return [self.heap[i][2] for i in chosen.tolist()]

    def state(self) -> dict:
        return {"heap": list(self.heap), "next": next(self._counter)}

    def load_state(self, state: dict) -> None:
        self.heap = list(state["heap"])
        heapq.heapify(self.heap)
        self._counter = itertools.count(state["next"])


# The rollout fields that hold one row per completion, with the value that pads them; left-padded ones first.
_PROMPT_FIELDS = {"prompt_ids": None, "prompt_mask": 0}
_COMPLETION_FIELDS = {
    "completion_ids": None,
    "completion_mask": 0,
    "model_mask": 0,
    "loss_mask": 0,
    "sampler_logps": 0.0,
    "old_logps": 0.0,
    "ref_logps": 0.0,
}
_ROW_FIELDS = ("finished", "rewards", "per_function_rewards", "advantages")


def _widen(tensor: torch.Tensor, width: int, value, left: bool) -> torch.Tensor:
    extra = width - tensor.shape[1]
    if extra <= 0:
        return tensor
    fill = tensor.new_full((tensor.shape[0], extra), value)
    return torch.cat([fill, tensor] if left else [tensor, fill], dim=1)


class GRPOWithReplayBufferTrainer(GRPOTrainer):
    """`GRPOWithReplayBufferTrainer(model, reward_funcs, args=GRPOWithReplayBufferConfig(...), train_dataset=...)`."""

    config_class = GRPOWithReplayBufferConfig

    @property
    def replay_buffer(self) -> ReplayBuffer:
        if getattr(self, "_replay_buffer", None) is None:
            self._replay_buffer = ReplayBuffer(self.args.replay_buffer_size)
        return self._replay_buffer

    @property
    def needs_old_logps(self) -> bool:
        return self.args.replay_buffer_size > 0 or super().needs_old_logps

    def make_rollout(self, rows, slots, round_index, mode="train") -> Rollout:
        rollout = super().make_rollout(rows, slots, round_index, mode)
        if mode != "train" or self.args.replay_buffer_size == 0:
            return rollout
        return self.replay(rollout, round_index)

    def replay(self, rollout: Rollout, round_index: int) -> Rollout:
        """Buffers this round's groups with variance, then swaps its zero-variance groups for buffered ones."""
        n = rollout.num_generations
        groups = range(len(rollout) // n)
        varied = [g for g in groups if group_has_variance(rollout.rewards[g * n : (g + 1) * n])]
        for g in varied:
            rewards = rollout.rewards[g * n : (g + 1) * n]
            rewards = rewards[~rewards.isnan()]
            advantages = rollout.advantages[g * n : (g + 1) * n]
            self.replay_buffer.add(float(rewards.std() * advantages.abs().sum()), self._group(rollout, g))
        idle = [g for g in groups if g not in varied]
        replaced = 0
        if idle and len(self.replay_buffer):
            generator = torch.Generator().manual_seed(
                derive_seed(self.args.seed, round_index, self.accelerator.process_index, _REPLAY_TAG)
            )
            rollout = self._put_groups(rollout, idle, self.replay_buffer.sample(len(idle), generator))
            rollout.step_tokens = self._step_token_totals(rollout)
            replaced = len(idle)
        counts = self.accelerator.gather(
            torch.tensor(
                [[replaced, len(groups), len(self.replay_buffer)]], dtype=torch.float32, device=self.accelerator.device
            )
        ).sum(0)
        self._metrics["train"]["replay_buffer/frac_replayed"].append(float(counts[0] / counts[1]))
        self._metrics["train"]["replay_buffer/size"].append(float(counts[2]))
        return rollout

    def _group(self, rollout: Rollout, g: int) -> dict:
        """Group g's rows, cut to the widths its own rows need, on the CPU."""
        n, rows = rollout.num_generations, slice(g * rollout.num_generations, (g + 1) * rollout.num_generations)
        prompt_width = int(rollout.prompt_mask[rows].sum(1).max())
        width = max(int(rollout.completion_mask[rows].sum(1).max()), 1)
        out = {"episodes": rollout.episodes[rows] if rollout.episodes else [{} for _ in range(n)]}
        for name in _PROMPT_FIELDS:
            out[name] = getattr(rollout, name)[rows, -prompt_width:].cpu()
        for name in _COMPLETION_FIELDS:
            value = getattr(rollout, name)
            out[name] = None if value is None else value[rows, :width].cpu()
        for name in _ROW_FIELDS:
            out[name] = getattr(rollout, name)[rows].cpu()
        return out

    def _put_groups(self, rollout: Rollout, targets: list[int], groups: list[dict]) -> Rollout:
        """The rollout with the groups at `targets` replaced by `groups`, all tensors widened to fit."""
        n, multiple = rollout.num_generations, rollout.pad_to_multiple_of or 1
        round_up = lambda width: -(-width // multiple) * multiple  # noqa: E731
        pad_id = self.processing_class.pad_token_id
        prompt_width = round_up(max([rollout.prompt_ids.shape[1]] + [g["prompt_ids"].shape[1] for g in groups]))
        width = round_up(max([rollout.completion_ids.shape[1]] + [g["completion_ids"].shape[1] for g in groups]))
        state = rollout.state()
        for fields, left, target_width in ((_PROMPT_FIELDS, True, prompt_width), (_COMPLETION_FIELDS, False, width)):
            for name, value in fields.items():
                if state[name] is None:
                    continue
                fill = pad_id if value is None else value
                tensor = _widen(state[name], target_width, fill, left).clone()
                for target, group in zip(targets, groups):
                    if group[name] is None:
                        raise ConfigError(
                            f"A buffered group lacks {name}; keep the options that produce it "
                            "(beta, use_vllm) fixed during a run."
                        )
                    tensor[target * n : (target + 1) * n] = _widen(group[name], target_width, fill, left).to(tensor)
                state[name] = tensor
        for name in _ROW_FIELDS:
            state[name] = state[name].clone()
            for target, group in zip(targets, groups):
                state[name][target * n : (target + 1) * n] = group[name].to(state[name])
        episodes = list(state["episodes"])
        if episodes:
            for target, group in zip(targets, groups):
                episodes[target * n : (target + 1) * n] = group["episodes"]
        state["episodes"] = episodes
        return Rollout(**state)

    # -- resuming ------------------------------------------------------------------------------------------
    def checkpoint_state(self) -> dict:
        return {**super().checkpoint_state(), "replay_buffer": self.replay_buffer.state()}

    def load_checkpoint_state(self, state: dict) -> None:
        state = dict(state)
        if "replay_buffer" in state:
            self.replay_buffer.load_state(state.pop("replay_buffer"))
        super().load_checkpoint_state(state)
