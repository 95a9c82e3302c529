"""The Ray settings are config fields like any other (so the command line has `--rollout_backend ray
--num_rollout_actors N`), checked before training: a wrong value names the field, and a setting the actors cannot
serve names the setting."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from posttrain.cli.parser import TrlParser
from posttrain.errors import ConfigError
from posttrain.online.producers.ray import make_ray_producer
from posttrain.trainers.grpo_config import GRPOConfig

pytestmark = [pytest.mark.ray]


def test_the_command_line_takes_the_ray_flags(tmp_path):
    (config,) = TrlParser([GRPOConfig]).parse_args_into_dataclasses(
        ["--output_dir", str(tmp_path), "--async_generation_rounds", "1", "--rollout_backend", "ray"]
        + ["--num_rollout_actors", "3", "--ray_address", "127.0.0.1:6379", "--rollout_request_timeout_s", "30"]
    )
    assert (config.rollout_backend, config.num_rollout_actors, config.ray_address) == ("ray", 3, "127.0.0.1:6379")
    assert (config.rollout_resource, config.rollout_request_timeout_s) == ("rollout", 30.0)


@pytest.mark.parametrize(
    "setting, message",
    [
        (dict(rollout_backend="rays"), r"rollout_backend='rays' is not one of \('local', 'ray'\)"),
        (dict(num_rollout_actors=0), "num_rollout_actors=0 must be at least 1"),
        (dict(rollout_request_timeout_s=0.0), "rollout_request_timeout_s=0.0 must be > 0"),
    ],
)
def test_a_wrong_value_names_the_field(tmp_path, setting, message):
    with pytest.raises(ConfigError, match=message):
        GRPOConfig(output_dir=str(tmp_path), **setting)


@pytest.mark.parametrize(
    "setting, named",
    [
        (dict(use_vllm=True), r"use_vllm=True with async_inflight_weight_updates=True"),
        (dict(async_generation_process=True), "async_generation_process=True"),
        (dict(cache_implementation="static"), "static cache"),
    ],
)
def test_a_setting_the_actors_cannot_serve_is_refused_before_any_actor_starts(setting, named):
    args = dict(use_vllm=False, async_generation_process=None, use_transformers_continuous_batching=False)
    args["async_inflight_weight_updates"] = True
    args = {**args, "cache_implementation": None, **setting}
    with pytest.raises(ConfigError, match=f"rollout_backend='ray' does not support .*{named}"):
        make_ray_producer(SimpleNamespace(args=SimpleNamespace(**args)), lookahead=1)


def test_vllm_with_actors_runs_in_the_actors_not_in_the_trainer(tmp_path, tiny_model_path, tokenizer):
    """Colocated vLLM beside training is refused on one machine, but with rollout actors the engines are theirs:
    the config passes, and the trainer's own sampling (evaluation) stays on transformers."""
    from transformers import AutoModelForCausalLM

    from posttrain.generation import TransformersBackend, create_generation_backend

    vllm = dict(output_dir=str(tmp_path), use_vllm=True, vllm_mode="colocate", async_generation_rounds=1)
    with pytest.raises(ConfigError, match="colocated vLLM runs inside the training process"):
        GRPOConfig(**vllm)
    config = GRPOConfig(**vllm, rollout_backend="ray", async_inflight_weight_updates=False)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path)
    assert isinstance(create_generation_backend(model, tokenizer, config), TransformersBackend)
