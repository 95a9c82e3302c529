"""The online config's fields that choose where asynchronous rollouts run: in this machine's generation process or
thread (`rollout_backend="local"`), or in rollout actors on a Ray cluster (`"ray"`, producers/ray.py,
docs/scaling.md). OnlineConfig inherits them, so every trainer's command line has `--rollout_backend ray
--num_rollout_actors N`."""

from __future__ import annotations

from dataclasses import dataclass

from posttrain.training.fields import config_field

__all__ = ["ROLLOUT_BACKENDS", "RolloutBackendFields"]

ROLLOUT_BACKENDS = ("local", "ray")


@dataclass
class RolloutBackendFields:
    rollout_backend: str = config_field(
        "local",
        "With async_generation_rounds: where rounds are sampled. 'local': a generation process or thread of this "
        "machine (async_generation_process); 'ray': num_rollout_actors rollout actors on a Ray cluster "
        "(pip install 'posttrain[ray]'; docs/scaling_rollouts.md), each with a vLLM engine where use_vllm=True.",
        choices=ROLLOUT_BACKENDS,
    )
    num_rollout_actors: int = config_field(
        1,
        "rollout_backend='ray': rollout actors; a round goes to one, or is split across those the rounds in "
        "flight leave idle (all of them at async_generation_rounds=0). Each samples with async_generation_cores "
        "threads (None: 1).",
        min=1,
    )
    ray_address: str | None = config_field(
        None,
        "rollout_backend='ray': the cluster to join ('auto', or the head's 'IP:6379'); None: a Ray started for "
        "this run on 127.0.0.1, without dashboard or usage reports.",
    )
    rollout_resource: str = config_field(
        "rollout",
        "rollout_backend='ray': the custom resource that marks rollout nodes (`ray start --resources "
        "'{\"rollout\": 1}'`); each actor takes one unit of it.",
    )
    rollout_request_timeout_s: float = config_field(
        600.0,
        "Seconds a rollout worker (a rollout actor, or the generation process) may go without answering a round "
        "(or, an actor, a weight sync) before it counts as hung, is replaced and gets its rounds again.",
        gt=0,
    )
