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


def test_under_bf16_autocast_the_actor_scores_with_the_trainers_forward(vllm_tiny_untied_path, tmp_path):
    """bf16=True: the trainer's forward runs under bf16 autocast over float32 weights. vLLM samples in the
    policy's parameter dtype (float32) in the actor as in the trainer's colocated engine, so round 0's tokens are
    the colocated engine's; at k = 0 the actor's log-probs come from its torch forward under the trainer's
    autocast, so they equal the trainer's (without it: float32 against bf16, off by ~1e-2). The colocated
    engine's own vLLM log-probs show the gap that remains at k >= 1, where the actor sends vLLM's."""
    pytest.importorskip("vllm")
    pytest.importorskip("ray")
    settings = dict(vllm_mode="colocate", vllm_kv_cache_gb=0.25, bf16=True)
    local = grpo_with_vllm(vllm_tiny_untied_path, tmp_path / "local", **settings)
    local_rollouts = record_rollouts(local)
    local.train()
    ray_settings = dict(async_generation_rounds=0, rollout_backend="ray", async_inflight_weight_updates=False)
    actors = grpo_with_vllm(vllm_tiny_untied_path, tmp_path / "ray", **ray_settings, **settings)
    actor_rollouts = record_rollouts(actors)
    actors.train()
    assert torch.equal(local_rollouts[0].completion_ids, actor_rollouts[0].completion_ids)  # the same weights
    actor_gap = logged_per_step(actors, "sampler/logp_diff_max")
    print(f"the actor's k = 0 log-probs vs the trainer's, max |logp diff| per step: {actor_gap}")
    assert actor_gap == [0.0] * 3
    vllm_gap = logged_per_step(local, "sampler/logp_diff_max")
    print(f"colocated vLLM (float32) vs the trainer's bf16 autocast, max |logp diff| per step: {vllm_gap}")
    assert all(1e-3 < gap < 0.05 for gap in vllm_gap)  # bf16 in effect on the trainer; float32 in vLLM
