"""The rank router of the Ray producer (posttrain/online/producers/ray_ranks.py) in one process (a gloo group of
one): it hands the producer the round's prompt ids and seeds, returns the producer's episodes, stops when they are
another round's, raises a round's failure where it happened, and refuses DeepSpeed ZeRO-3 before training. Two
gloo processes: a round rank 0's producer answers wrongly or fails on stops every rank, not only those whose rows
are wrong (the others would wait in their next collective). The two-process routing with Ray actors (each rank its
own rows) is tests/dist/test_ray_ranks.py."""

from __future__ import annotations

import socket

import pytest
import torch
import torch.distributed as dist
from torch import nn

from posttrain.errors import ConfigError
from posttrain.online.producers.ray_ranks import RankRouter
from posttrain.online.rollout import PROMPT_IDS_COLUMN, Episode


@pytest.fixture
def group():
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


class Context:
    policy = nn.Linear(2, 2)


class FakeProducer:
    """Answers a round with one episode per completion, its token the seed; `swap` answers with the rows swapped."""

    version, sync_steps = None, 1

    def __init__(self, swap: bool = False, fail: bool = False, drop: int = 0):
        self.swap, self.fail, self.drop, self.asked, self.pushed = swap, fail, drop, [], []

    def episodes(self, round_index, rows, n, seeds):
        self.asked.append((round_index, [row[PROMPT_IDS_COLUMN] for row in rows], seeds))
        if self.fail:
            raise ValueError("the actor broke")
        order = rows[::-1] if self.swap else rows
        episodes = [
            Episode([seed, k], [1, 1], None, True, prompt_ids=row[PROMPT_IDS_COLUMN])
            for row, seed in zip(order, seeds)
            for k in range(n)
        ]
        return episodes[: len(episodes) - self.drop]

    def push_weights(self, version):
        self.pushed.append(version)


def test_the_round_goes_to_the_producer_and_comes_back(group):
    inner = FakeProducer()
    router = RankRouter(Context(), inner)
    rows = [{PROMPT_IDS_COLUMN: [5, 6]}, {PROMPT_IDS_COLUMN: [7]}]
    episodes = router.episodes(3, rows, 2, [11, 12])
    assert inner.asked == [(3, [[5, 6], [7]], [11, 12])]
    assert [(e.prompt_ids, e.token_ids) for e in episodes] == [
        ([5, 6], [11, 0]),
        ([5, 6], [11, 1]),
        ([7], [12, 0]),
        ([7], [12, 1]),
    ]
    router.push_weights(1)  # unsharded: rank 0's producer takes the version, nothing is gathered
    assert inner.pushed == [1] and router.snapshot is None
    assert [p.data_ptr() for p in inner.gathered(1)] == [p.data_ptr() for p in Context.policy.parameters()]


def test_episodes_of_other_prompts_stop_training(group):
    router = RankRouter(Context(), FakeProducer(swap=True))
    with pytest.raises(RuntimeError, match="would get episodes of other prompts"):
        router.episodes(0, [{PROMPT_IDS_COLUMN: [5]}, {PROMPT_IDS_COLUMN: [7]}], 1, [1, 2])


def test_a_failed_round_raises_its_own_error(group):
    router = RankRouter(Context(), FakeProducer(fail=True))
    with pytest.raises(ValueError, match="the actor broke"):
        router.episodes(0, [{PROMPT_IDS_COLUMN: [5]}], 1, [1])


def test_zero3_is_refused_before_training():
    class Zero3Context:
        policy = nn.Linear(2, 2)

    Zero3Context.policy.weight.ds_id = 0  # how DeepSpeed marks a partitioned parameter
    with pytest.raises(ConfigError, match="ZeRO-3"):
        RankRouter.around(Zero3Context(), lambda context: None)
    assert not dist.is_initialized()


def test_zero3_partitioning_after_construction_stops_at_the_first_push(group):
    """A model loaded without zero.Init is partitioned when the engine prepares it, after the router is built."""

    class LaterContext:
        policy = nn.Linear(2, 2)

    inner = FakeProducer()
    router = RankRouter(LaterContext(), inner)
    LaterContext.policy.weight.ds_id = 0
    with pytest.raises(ConfigError, match="ZeRO-3"):
        router.push_weights(0)
    assert inner.pushed == []


def _two_ranks(rank, rendezvous, out, cases):
    """One of two training processes: each case a round whose rank-0 producer is FakeProducer(**case); what
    each rank raised (or got) goes to `out`/rank<rank>.json."""
    import json

    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=2)
    outcomes = []
    try:
        for case in cases:
            router = RankRouter(Context(), FakeProducer(**case) if rank == 0 else None)
            rows = [{PROMPT_IDS_COLUMN: [10 * rank + 1]}, {PROMPT_IDS_COLUMN: [10 * rank + 2]}]
            try:
                episodes = router.episodes(0, rows, 2, [rank, rank + 5])
                outcomes.append(["ok", [e.token_ids for e in episodes]])
            except Exception as error:
                outcomes.append([type(error).__name__, str(error)])
    finally:
        dist.destroy_process_group()
    (out / f"rank{rank}.json").write_text(json.dumps(outcomes))


def test_a_round_rank_0_answers_wrongly_or_fails_on_stops_every_rank(tmp_path):
    import json

    import torch.multiprocessing as mp

    cases = [{}, {"drop": 1}, {"swap": True}, {"fail": True}]
    mp.start_processes(_two_ranks, args=(tmp_path / "rendezvous", tmp_path, cases), nprocs=2, start_method="spawn")
    first, second = (json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in (0, 1))
    # each rank its own rows' completions (the token is the seed the rank sent)
    assert first[0] == ["ok", [[0, 0], [0, 1], [5, 0], [5, 1]]]
    assert second[0] == ["ok", [[1, 0], [1, 1], [6, 0], [6, 1]]]
    # a round one episode short: rank 0's own rows are right, yet both stop
    assert first[1][0] == second[1][0] == "RuntimeError" and "7 episodes, not the 8" in first[1][1]
    assert "Rank 0's rollout producer failed on round 0" in second[1][1] and "7 episodes" in second[1][1]
    assert first[2][0] == second[2][0] == "RuntimeError" and "ranks [0, 1]" in first[2][1]
    assert first[3] == ["ValueError", "the actor broke"] and "ValueError: the actor broke" in second[3][1]
