"""The weight transport of rollout actors (posttrain/online/weights/collective.py, producers/ray_actor.py): after a
push, every actor holds bit for bit the trainer's flat buffers under the pushed version (compared by hash, and through
Ray's object store as an independent oracle), for a model with tied embeddings and for a PEFT-merged one; a push
to an actor that is gone fails within its deadline, naming the actor and the version."""

from __future__ import annotations

import pytest
import ray
import torch
from peft import LoraConfig, get_peft_model

from posttrain.generation import SamplingParams
from posttrain.models.tiny import build_tiny_model
from posttrain.online.producers.generation_worker import WorkerSettings
from posttrain.online.producers.ray_actor import rollout_actor_class
from posttrain.online.weights.collective import PairSender, open_store
from posttrain.online.weights.transport import WeightSyncError, buffer_hashes, flat_buffers, flat_layout, pack

pytestmark = [pytest.mark.ray]
HOST = "127.0.0.1"


def settings(tokenizer) -> WorkerSettings:
    return WorkerSettings(
        pad_token_id=tokenizer.pad_token_id,
        stop_ids=(tokenizer.eos_token_id,),
        sampling=SamplingParams(max_tokens=4),
        logps_temperature=1.0,
        micro_batch_size=4,
        pad_multiple=None,
        in_flight=False,
        exact_logps=True,
        cpus=None,
        threads=1,
    )


def start_actors(model, tokenizer, count: int = 2):
    remote = rollout_actor_class(resources={"rollout": 1}, num_cpus=0)
    actors = [remote.remote(model, settings(tokenizer), 3, f"rollout actor {i}") for i in range(count)]
    senders = []
    for index, actor in enumerate(actors):
        store = open_store(HOST, 60)
        ref = actor.connect.remote(HOST, store.port, 60)
        senders.append(PairSender(store, HOST, f"rollout actor {index}", 60))
        ray.get(ref, timeout=60)
    return actors, senders


def push(actors, senders, buffers, version: int) -> None:
    refs = [actor.receive.remote([]) for actor in actors]
    for sender in senders:
        sender.send(buffers, version)
    assert ray.get(refs, timeout=60) == [version] * len(actors)


def peft_merged(tokenizer):
    model = get_peft_model(build_tiny_model(tokenizer, seed=1, tie=False), LoraConfig(r=4, target_modules=["q_proj"]))
    for name, param in model.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(param, std=0.1)  # else the merge changes nothing
    return model.merge_and_unload()


@pytest.mark.parametrize("kind", ["tied", "peft_merged"])
def test_every_actor_holds_the_pushed_buffers_and_version(ray_cluster, tokenizer, kind):
    model = build_tiny_model(tokenizer, seed=0) if kind == "tied" else peft_merged(tokenizer)
    if kind == "tied":
        assert model.get_output_embeddings().weight is model.get_input_embeddings().weight
    actors, senders = start_actors(model, tokenizer)
    layout = flat_layout(model)
    for version, scale in [(3, 1.5), (5, -0.25)]:
        with torch.no_grad():
            for param in model.parameters():
                param.mul_(scale)
        buffers = pack([p for _, p in model.named_parameters()], flat_buffers(layout))
        push(actors, senders, buffers, version)
        want = buffer_hashes(buffers)
        assert ray.get([actor.hashes.remote(version) for actor in actors]) == [want, want]
        for copy in ray.get([actor.buffers.remote(version) for actor in actors]):  # the object store as the oracle
            assert {k: torch.equal(v, buffers[getattr(torch, k.split(".")[1])]) for k, v in copy.items()} == {
                str(dtype): True for dtype in buffers
            }
    assert ray.get(actors[0].hashes.remote(3)) != ray.get(actors[0].hashes.remote(5))  # both versions are kept
    for actor in actors:
        ray.kill(actor)


def test_a_push_to_a_dead_actor_names_the_actor_and_the_version(ray_cluster, tokenizer):
    model = build_tiny_model(tokenizer, seed=0)
    actors, senders = start_actors(model, tokenizer, count=1)
    buffers = pack([p for _, p in model.named_parameters()], flat_buffers(flat_layout(model)))
    push(actors, senders, buffers, 1)
    ray.kill(actors[0], no_restart=True)
    senders[0].timeout_s = 5
    with pytest.raises(WeightSyncError, match=r"weights version 7 to rollout actor 0"):
        for _ in range(3):  # the first sends may still land in the socket's buffer
            senders[0].send(buffers, 7)


def test_an_actor_waiting_for_a_push_that_never_comes_fails_naming_itself(ray_cluster, tokenizer):
    model = build_tiny_model(tokenizer, seed=0)
    remote = rollout_actor_class(resources={"rollout": 1}, num_cpus=0)
    actor = remote.remote(model, settings(tokenizer), 3, "rollout actor 9")
    ray.get(actor.where.remote(), timeout=120)  # started (which takes longer than the 3 s deadline below)
    store = open_store(HOST, 3)
    ref = actor.connect.remote(HOST, store.port, 3)
    sender = PairSender(store, HOST, "rollout actor 9", 3)  # alive, and silent
    ray.get(ref, timeout=60)
    with pytest.raises(ray.exceptions.RayTaskError, match="rollout actor 9 received no weights header"):
        ray.get(actor.receive.remote([]), timeout=60)
    ray.kill(actor)
    sender.close()
