"""vLLM inside a rollout actor (use_vllm=True with rollout_backend="ray", producers/ray_vllm.py): the actor's engine,
given each version of the weights over its weight pair, samples every round's tokens as the trainer's own colocated
engine does with the same weights and seeds, and its log-probs at k = 0 are the trainer's. Needs vLLM and Ray in the
same environment (scripts/setup_vllm.sh installs both); Ray is started by the run itself, on 127.0.0.1."""

from __future__ import annotations

import os

import pytest
import torch
from _rollouts import record_rollouts
from _vllm_reference import grpo_with_vllm, logged_per_step

pytestmark = [pytest.mark.vllm, pytest.mark.ray]

os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("RAY_ENABLE_UV_RUN_RUNTIME_ENV", "0")


def test_a_rollout_actor_samples_with_vllm_as_the_colocated_engine(vllm_tiny_untied_path, tmp_path):
    pytest.importorskip("vllm")
    ray = pytest.importorskip("ray")
    from posttrain.online.producers.ray import RayRolloutProducer

    memory = dict(vllm_mode="colocate", vllm_kv_cache_gb=0.25)
    local = grpo_with_vllm(vllm_tiny_untied_path, tmp_path / "local", **memory)
    local_rollouts = record_rollouts(local)
    local.train()
    actors = grpo_with_vllm(
        vllm_tiny_untied_path,
        tmp_path / "ray",
        async_generation_rounds=0,
        rollout_backend="ray",
        async_inflight_weight_updates=False,
        **memory,
    )
    assert isinstance(actors.rollout_producer, RayRolloutProducer)
    actor_rollouts = record_rollouts(actors)
    actors.train()
    assert len(actor_rollouts) == len(local_rollouts) == 3
    for one, other in zip(local_rollouts, actor_rollouts, strict=True):
        # the weights move every step: only an engine given each new version samples these tokens
        assert torch.equal(one.completion_ids, other.completion_ids)
    assert len(set(map(str, (r.completion_ids for r in actor_rollouts)))) == 3
    assert logged_per_step(actors, "sampler/logp_diff_max") == [0.0] * 3  # k = 0: the trainer's own forward
    assert logged_per_step(actors, "loss") == pytest.approx(logged_per_step(local, "loss"), rel=1e-3, abs=1e-4)
    assert actors.rollout_producer.actors is None and not ray.is_initialized()  # its Ray ended with the run
