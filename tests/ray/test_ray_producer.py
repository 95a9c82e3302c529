"""Training with rollout actors (rollout_backend="ray", posttrain/online/producers/ray.py) on the loopback cluster:
the same tokens, losses and final weights as the generation process at k = 0 and (with actors lost) at k = 2 with
vllm_sync_steps=2, a k = 0 round split across the actors, actors only on `rollout` nodes and none left after
training, in-flight updates with each token's version and log-prob, and faults (an actor killed, its node removed,
an actor alive but silent, a round that raises)."""

from __future__ import annotations

import re

import pytest
import ray
import torch
from _rollouts import record_rollouts
from test_engine import stopping_model
from test_producers_process import PROCESS, assert_same_parameters, same_threads
from test_producers_thread import WeightsAtStepBegin, grpo, losses

from posttrain.online.logps import completion_logps
from posttrain.online.producers.ray import RayRolloutProducer, split_round
from posttrain.online.rollout import pad_rows

pytestmark = [pytest.mark.ray]
RAY = dict(rollout_backend="ray")


def alive_actors() -> list[dict]:
    """The actors the GCS does not count as dead (read from its table: the state API needs the dashboard)."""
    return [a for a in ray._private.state.actors().values() if a["State"] != "DEAD"]


class AfterDispatch:
    """Calls `fault(producer, index)` once, right after request `request_id` was sent to actor `index`."""

    def __init__(self, producer: RayRolloutProducer, request_id: int, fault):
        self.producer, self.request_id, self.fault, self.done = producer, request_id, fault, False
        self.dispatch = producer._dispatch
        producer._dispatch = self

    def __call__(self, request_id: int, index: int) -> None:
        self.dispatch(request_id, index)
        if request_id == self.request_id and not self.done:
            self.done = True
            self.fault(self.producer, index)


def test_k0_is_the_generation_process_bitwise_on_rollout_nodes(ray_cluster, tmp_path, tiny_model_path, same_threads):
    process = grpo(stopping_model(tiny_model_path), tmp_path / "process", async_generation_rounds=0, **PROCESS)
    process_rollouts = record_rollouts(process)
    process.train()
    actors = grpo(stopping_model(tiny_model_path), tmp_path / "ray", async_generation_rounds=0, **RAY)
    assert isinstance(actors.rollout_producer, RayRolloutProducer)
    actor_rollouts = record_rollouts(actors)
    seen = {}

    class Where(WeightsAtStepBegin):
        def on_step_end(self, args, state, control, **kwargs):
            seen.setdefault("where", list(actors.rollout_producer.where))

    actors.add_callback(Where())
    actors.train()
    for one, other in zip(process_rollouts, actor_rollouts, strict=True):
        assert torch.equal(one.completion_ids, other.completion_ids)
        assert [e["token_versions"] for e in one.episodes] == [e["token_versions"] for e in other.episodes]
        assert torch.equal(one.sampler_logps, other.sampler_logps)
    assert losses(actors) == losses(process)
    assert_same_parameters(process, actors)
    rollout_nodes = {node.node_id for node in ray_cluster.rollout_nodes}
    assert {where["node_id"] for where in seen["where"]} <= rollout_nodes
    assert all(where["threads"] == 1 for where in seen["where"])
    assert actors.rollout_producer.actors is None and alive_actors() == []  # none left after training


@pytest.mark.parametrize(
    ("prompts", "parts", "n", "micro_batch", "expected"),
    [
        (4, 2, 4, 8, [(0, 2), (2, 4)]),
        (2, 2, 4, 8, [(0, 2)]),
        (5, 2, 2, 2, [(0, 2), (2, 5)]),
        (7, 3, 3, 6, [(0, 2), (2, 4), (4, 7)]),
    ],
)
def test_a_round_splits_along_whole_micro_batches(prompts, parts, n, micro_batch, expected):
    ranges = split_round(prompts, parts, n, micro_batch)
    assert [(r.start, r.stop) for r in ranges] == expected
    assert all(r.start * n % micro_batch == 0 for r in ranges)


@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16"])
def test_k0_splits_each_round_across_the_actors_and_is_the_synchronous_run(
    ray_cluster, tmp_path, tiny_model_path, bf16
):
    """Two actors at k = 0 sample each round's halves at once; put back together, the round is the one the trainer
    samples itself (tokens, sampler log-probs, losses and final weights, bit for bit). A round of 2 micro-batches:
    a part is whole micro-batches (split_round). With bf16 the actors run the trainer's autocast over the float32
    weights they receive."""
    common = dict(max_steps=4, steps_per_generation=2, per_device_train_batch_size=8, num_generations=4, bf16=bf16)
    sync = grpo(stopping_model(tiny_model_path), tmp_path / "sync", **common)
    sync_rollouts = record_rollouts(sync)
    sync.train()
    split = grpo(
        stopping_model(tiny_model_path),
        tmp_path / "split",
        async_generation_rounds=0,
        num_rollout_actors=2,
        **common,
        **RAY,
    )
    split_rollouts, sent = record_rollouts(split), []
    dispatch = split.rollout_producer._dispatch
    split.rollout_producer._dispatch = lambda rid, index: (sent.append((rid, index)), dispatch(rid, index))
    split.train()
    assert sent == [(0, 0), (1, 1), (2, 0), (3, 1)]  # two rounds of 4 prompts, each as 2 + 2 on both actors
    for one, other in zip(sync_rollouts, split_rollouts, strict=True):
        assert torch.equal(one.completion_ids, other.completion_ids)
    # the actors' log-probs are the trainer's, bit for bit: the parts' forwards took the unsplit micro-batches
    assert all(h["sampler/logp_diff_max"] == 0.0 for h in split.state.log_history if "loss" in h)
    assert losses(split) == losses(sync)
    assert_same_parameters(sync, split)


def test_in_flight_updates_record_each_tokens_version_and_log_prob(ray_cluster, tmp_path, tiny_model_path):
    weights = WeightsAtStepBegin()
    trainer = grpo(
        stopping_model(tiny_model_path, num_stops=0),
        tmp_path,
        callbacks=[weights],
        max_steps=4,
        async_generation_rounds=1,
        num_rollout_actors=2,
        **RAY,
    )
    rollouts = record_rollouts(trainer)
    trainer.train()
    model, checked = stopping_model(tiny_model_path, num_stops=0).eval(), 0
    steps_per_round = trainer.args.steps_per_generation * trainer.args.num_iterations
    for rollout in rollouts:
        for row, episode in enumerate(rollout.episodes):
            versions = episode["token_versions"]
            assert versions == sorted(versions) and max(versions) <= rollout.round * steps_per_round
            if len(set(versions)) > 1:
                continue  # a swap inside the completion: the cache mixes versions (tested in test_async_process.py)
            model.load_state_dict(weights.weights[versions[0]])
            checked += check_log_probs(model, rollout, row, trainer)
    assert checked > 0


def check_log_probs(model, rollout, row: int, trainer) -> int:
    length = int(rollout.completion_mask[row].sum())
    ids = rollout.completion_ids[row : row + 1, :length]
    prompt = rollout.prompt_ids[row][rollout.prompt_mask[row].bool()]
    pad = trainer.processing_class.pad_token_id
    prompts, prompt_mask = pad_rows([prompt.tolist()], pad, True)
    completion, mask = pad_rows([ids[0].tolist()], pad, False)
    batch = {"prompt_ids": prompts, "prompt_mask": prompt_mask, "completion_ids": completion, "completion_mask": mask}
    with torch.no_grad():
        expected, _ = completion_logps(model, batch, trainer.logps_temperature)
    sampled = rollout.sampler_logps[row, :length]
    torch.testing.assert_close(sampled.float(), expected[0, :length].float(), atol=1e-4, rtol=0)
    return 1


def kill_actor(producer, index):
    ray.kill(producer.actors[index], no_restart=False)


def remove_its_node(producer, index):
    cluster = producer.test_cluster
    node = next(n for n in cluster.rollout_nodes if n.node_id == producer.where[index]["node_id"])
    cluster.remove_node(node, allow_graceful=False)
    cluster.rollout_nodes = [n for n in cluster.rollout_nodes if n is not node] + [cluster.add_rollout_node()]


@pytest.mark.parametrize("fault", [kill_actor, remove_its_node], ids=["ray_kill", "remove_node"])
def test_a_lost_actor_is_replaced_and_the_run_is_the_uninterrupted_one(
    ray_cluster, tmp_path, tiny_model_path, uninterrupted, faulty_settings, caplog, fault
):
    common, plain = faulty_settings, uninterrupted
    faulty = grpo(tiny_model_path, tmp_path / "faulty", **common, **RAY)
    faulty.rollout_producer.test_cluster = ray_cluster
    injected = AfterDispatch(faulty.rollout_producer, request_id=2, fault=fault)
    with caplog.at_level("WARNING", logger="posttrain"):
        faulty.train()
    assert injected.done
    # Seen as an answer that never comes ("died") or as the next weight push failing, whichever comes first.
    assert re.search(r"rollout actor 0 \(node 127\.0\.0\.1, pid \d+\) (died|failed).*; restarting it", caplog.text)
    assert sum(h["async/generation_restarts"] for h in faulty.state.log_history if "loss" in h) == 1
    assert losses(faulty) == losses(plain)
    assert_same_parameters(plain, faulty)


def test_a_silent_actor_is_replaced_after_the_deadline(ray_cluster, tmp_path, tiny_model_path, caplog):
    trainer = grpo(
        tiny_model_path, tmp_path, max_steps=3, async_generation_rounds=1, rollout_request_timeout_s=8, **RAY
    )
    injected = AfterDispatch(trainer.rollout_producer, 1, lambda p, i: p.actors[i].pause.remote(3600))
    with caplog.at_level("WARNING", logger="posttrain"):
        trainer.train()
    assert injected.done and trainer.state.global_step == 3
    assert "answered nothing for 8 s (rollout_request_timeout_s); restarting it" in caplog.text


def test_a_round_that_raises_stops_training_naming_the_actor(ray_cluster, tmp_path, tiny_model_path):
    trainer = grpo(tiny_model_path, tmp_path, max_steps=2, async_generation_rounds=0, **RAY)
    producer = trainer.rollout_producer
    submit = producer._submit

    def out_of_vocabulary(rows, seeds):
        return submit([{**row, "prompt_ids": [10**6]} for row in rows], seeds)

    producer._submit = out_of_vocabulary
    with pytest.raises(RuntimeError, match=r"rollout actor 0 \(node 127\.0\.0\.1, pid \d+\) failed on a round"):
        trainer.train()
    producer.close()
    assert alive_actors() == []
