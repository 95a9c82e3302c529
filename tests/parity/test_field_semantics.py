"""A TRL config means the same thing on posttrain: each field below is set the same way in TRL 1.16's config class
and in posttrain's, and the quantities derived from it (batch sizes, rounds, optimizer steps, lengths, memory)
are compared. The defaults of every field the two share are compared too, with the few deliberate differences
named here and on docs/trl_parity.md.

Fields swept (TRL's GRPO/RLOO/DPO/SFT/KTO/Reward configs): every shared field's default (test below);
steps_per_generation and generation_batch_size (unit: micro-batches, default gradient_accumulation_steps);
max_prompt_length (online trainers: no cut by default); vllm_gpu_memory_utilization (colocate mode: honoured on a
GPU, an error on a CPU naming vllm_kv_cache_gb); the reward model's max_length (rows dropped in both); bf16 (None:
on unless fp16 is set, on every device, for every config class TRL 1.16 has, experimental ones included).
"""

from __future__ import annotations

import dataclasses
import logging
import warnings

import pytest
import torch
from _trl import import_trl, import_trl_experimental
from test_engine import make_config, prompt_dataset

import posttrain
from posttrain.errors import ConfigError
from posttrain.generation.vllm_memory import CPU_KV_CACHE_GB, colocate_memory
from posttrain.trainers.grpo import GRPOConfig, GRPOTrainer

ONLINE = ["GRPOConfig", "RLOOConfig"]
ALL = [*ONLINE, "DPOConfig", "SFTConfig", "KTOConfig", "RewardConfig"]
MODULES = ["grpo_config", "rloo_config", "dpo_config", "sft_config", "kto_config", "reward_config"]

# Shared fields whose default differs, with the reason (the same training follows on the machines TRL targets).
DEFAULT_DIFFERENCES = {
    "gradient_checkpointing": "None: on with an accelerator as in TRL, off on a CPU (docs/trl_parity.md)",
    "activation_checkpointing": "TRL's alias of gradient_checkpointing, resolved the same way",
    "pad_to_multiple_of": "'auto': no padding (TRL's None) except on Neuron, which needs fixed widths",
}


def both(name: str, tmp_path, **settings):
    """TRL's and posttrain's `name` built from the same settings."""
    trl = import_trl(*MODULES)
    settings = dict(output_dir=str(tmp_path), report_to="none", use_cpu=True, **settings)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return getattr(trl, name)(**settings), getattr(posttrain, name)(**settings)


@pytest.mark.parametrize("name", ALL)
def test_every_shared_default_is_trls(name, tmp_path):
    theirs, ours = both(name, tmp_path)
    differ = {
        f.name: (getattr(theirs, f.name), getattr(ours, f.name))
        for f in dataclasses.fields(theirs)
        if hasattr(ours, f.name)
        and f.name not in DEFAULT_DIFFERENCES
        and f.name not in ("output_dir", "logging_dir", "run_name")
        and str(getattr(theirs, f.name)) != str(getattr(ours, f.name))
    }
    assert differ == {}
    assert "max_prompt_length" not in {f.name for f in dataclasses.fields(theirs)} or name not in ONLINE


# -- bf16: None means "on unless fp16", on every device, for every config ------------------------------------------
# (module under trl.experimental or None for top level, class) for every config class TRL 1.16 has
TRL_CONFIGS = [(None, name) for name in [*ALL, "DistillationConfig"]] + [
    ("a2po", "A2POConfig"), ("async_distillation", "AsyncDistillationConfig"), ("async_grpo", "AsyncGRPOConfig"),
    ("cpo", "CPOConfig"), ("distillation", "DistillationConfig"), ("gkd", "GKDConfig"), ("gmpo", "GMPOConfig"),
    ("gold", "GOLDConfig"), ("iw_opd", "IWOPDConfig"), ("kto", "KTOConfig"), ("online_dpo", "OnlineDPOConfig"),
    ("orpo", "ORPOConfig"), ("sdft", "SDFTConfig"), ("sdpo", "SDPOConfig"), ("tpo", "TPOConfig"),
    ("server_distillation", "ServerDistillationConfig"),
]  # fmt: skip
PRECISION_SETTINGS = [{}, dict(fp16=True), dict(bf16=False), dict(bf16=True), dict(bf16=False, fp16=True)]


def _config_pair(module: str | None, name: str):
    if module is None:
        return getattr(import_trl(*MODULES, "distillation_config"), name), getattr(posttrain, name)
    ours = __import__(f"posttrain.experimental.{module}", fromlist=[name])
    return getattr(import_trl_experimental(module), name), getattr(ours, name)


@pytest.mark.parametrize("module, name", TRL_CONFIGS, ids=[f"{m or 'trl'}.{n}" for m, n in TRL_CONFIGS])
@pytest.mark.parametrize("settings", PRECISION_SETTINGS, ids=["default", "fp16", "off", "on", "off_fp16"])
def test_bf16_resolves_as_trl(module, name, settings, tmp_path):
    """TRL 1.16 resolves bf16=None to `not fp16` on any device, so a CPU run trains under bf16 autocast."""
    theirs, ours = _config_pair(module, name)
    if name == "ServerDistillationConfig":
        settings = dict(settings, teacher_model_server_url="http://127.0.0.1:8000")
    settings = dict(output_dir=str(tmp_path), report_to="none", use_cpu=True, **settings)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        theirs, ours = theirs(**settings), ours(**settings)
    assert (ours.bf16, ours.fp16, ours.mixed_precision) == (theirs.bf16, theirs.fp16, theirs.mixed_precision)
    assert ours.bf16 is (settings.get("bf16", True) and not settings.get("fp16", False))


@pytest.mark.skipif(torch.cuda.is_available(), reason="transformers checks bf16 against the accelerator there")
def test_bf16_default_without_use_cpu_on_a_cpu_is_what_trl_gives_with_it(tmp_path):
    """TRL's default config stops on a machine without an accelerator unless use_cpu is set (transformers refuses
    bf16 there); posttrain resolves bf16 the same way and trains on the CPU, which is where the run is anyway."""
    trl = import_trl(*MODULES)
    settings = dict(output_dir=str(tmp_path), report_to="none")
    with pytest.raises(ValueError, match="use_cpu"):
        trl.SFTConfig(**settings)
    ours = posttrain.SFTConfig(**settings)
    assert (ours.bf16, ours.mixed_precision, ours.use_cpu) == (True, "bf16", True)
    theirs = trl.SFTConfig(**settings, use_cpu=True)
    assert (ours.bf16, ours.mixed_precision) == (theirs.bf16, theirs.mixed_precision)
    ours = posttrain.SFTConfig(**settings, bf16=False)
    assert (ours.bf16, ours.mixed_precision, ours.use_cpu) == (False, "no", False)


# -- steps_per_generation / generation_batch_size: micro-batches, as in TRL ------------------------------------
@pytest.mark.parametrize("name", ONLINE)
@pytest.mark.parametrize(
    "settings",
    [
        dict(per_device_train_batch_size=4, gradient_accumulation_steps=2, steps_per_generation=8, num_generations=4),
        dict(per_device_train_batch_size=4, gradient_accumulation_steps=2, generation_batch_size=16, num_generations=4),
        dict(per_device_train_batch_size=4, gradient_accumulation_steps=3, num_generations=4),
        dict(per_device_train_batch_size=6, gradient_accumulation_steps=1, steps_per_generation=2, num_generations=3),
        dict(per_device_train_batch_size=2, gradient_accumulation_steps=4, generation_batch_size=16, num_generations=2),
    ],
    ids=["issue_example", "generation_batch", "default_is_accumulation", "no_accumulation", "batch_of_two_steps"],
)
def test_generation_batch_and_steps_as_trl(name, settings, tmp_path):
    theirs, ours = both(name, tmp_path, **settings)
    assert (ours.generation_batch_size, ours.steps_per_generation) == (
        theirs.generation_batch_size,
        theirs.steps_per_generation,
    )
    # TRL generates every steps_per_generation micro-steps and steps the optimizer every gradient_accumulation_steps
    assert ours.optimizer_steps_per_generation == theirs.steps_per_generation / theirs.gradient_accumulation_steps


def test_the_issue_example_is_a_batch_of_32_and_four_optimizer_steps(tmp_path):
    _, ours = both(
        "GRPOConfig",
        tmp_path,
        per_device_train_batch_size=4,
        gradient_accumulation_steps=2,
        steps_per_generation=8,
        num_generations=4,
    )
    assert (ours.generation_batch_size, ours.optimizer_steps_per_generation) == (32, 4)


def test_a_round_smaller_than_an_optimizer_step_is_refused_with_the_fix(tmp_path):
    with pytest.raises(ConfigError, match=r"steps_per_generation=1 .* multiple of gradient_accumulation_steps=2"):
        make_config(tmp_path, per_device_train_batch_size=4, gradient_accumulation_steps=2, steps_per_generation=1)


def test_training_schedule_generates_as_often_as_trl(tiny_model_path, tmp_path):
    """gradient_accumulation_steps=2, steps_per_generation=4: TRL generates every 4 micro-steps, so 4 optimizer
    steps take 2 rounds (the old optimizer-step unit took 1)."""
    calls = []

    def reward(completions, **kwargs):
        calls.append(len(completions))
        return [float(len(c)) for c in completions]

    config = make_config(
        tmp_path,
        per_device_train_batch_size=4,
        gradient_accumulation_steps=2,
        steps_per_generation=4,
        max_steps=4,
    )
    trainer = GRPOTrainer(tiny_model_path, reward, args=config, train_dataset=prompt_dataset())
    trainer.train()
    micro_steps = config.max_steps * config.gradient_accumulation_steps
    assert trainer.state.global_step == 4
    assert calls == [config.generation_batch_size] * (micro_steps // config.steps_per_generation) == [16, 16]


# -- max_prompt_length: TRL's GRPO/RLOO have none and never cut a prompt ----------------------------------------
@pytest.mark.parametrize("name", ONLINE)
def test_online_trainers_do_not_cut_prompts_by_default(name, tmp_path):
    theirs, ours = both(name, tmp_path)
    assert not hasattr(theirs, "max_prompt_length") and ours.max_prompt_length is None


@pytest.mark.parametrize("module, name", [("a2po", "A2POConfig"), ("sdft", "SDFTConfig"), ("iw_opd", "IWOPDConfig")])
def test_where_trl_has_max_prompt_length_the_default_is_its(module, name, tmp_path):
    theirs = getattr(import_trl_experimental(module), name)
    ours = getattr(__import__(f"posttrain.experimental.{module}", fromlist=[name]), name)
    field = {f.name: f.default for f in dataclasses.fields(theirs)}["max_prompt_length"]
    assert {f.name: f.default for f in dataclasses.fields(ours)}["max_prompt_length"] == field


def test_a_prompt_limit_cuts_and_the_log_counts_the_rows(tiny_model_path, tmp_path, caplog):
    long = "one two three four five six seven eight nine ten " * 8
    data = prompt_dataset(8).map(lambda row, i: {"prompt": long if i in (2, 5) else row["prompt"]}, with_indices=True)
    config = make_config(tmp_path, max_prompt_length=40)
    trainer = GRPOTrainer(
        tiny_model_path, lambda completions, **k: [0.0] * len(completions), args=config, train_dataset=data
    )
    lengths = [len(trainer.processing_class(p)["input_ids"]) for p in data["prompt"]]
    report = posttrain.data.report.DataReport.of(trainer)
    with caplog.at_level(logging.WARNING, logger="posttrain"):
        summary = report.emit(None)
    section = next(iter(summary.values()))
    assert (section["rows_truncated"], section["tokens_cut"]) == (2, sum(n - 40 for n in lengths if n > 40))
    assert "2 truncated" in caplog.text and "max_prompt_length" in caplog.text
    assert max(len(ids) for ids in trainer.train_dataset["prompt_ids"]) == 40


# -- vllm_gpu_memory_utilization: honoured on a GPU, an error on a CPU ------------------------------------------
@pytest.mark.parametrize("name", ONLINE)
def test_gpu_memory_utilization_sizes_colocated_vllm_on_a_gpu(name, tmp_path):
    theirs, ours = both(name, tmp_path, vllm_gpu_memory_utilization=0.5)
    assert colocate_memory(ours, "cuda") == (None, theirs.vllm_gpu_memory_utilization) == (None, 0.5)
    _, ours = both(name, tmp_path)
    assert colocate_memory(ours, "cuda") == (None, 0.3)
    assert colocate_memory(ours, "cpu") == (CPU_KV_CACHE_GB, 0.3)


def test_gpu_memory_utilization_is_never_silently_overridden(tmp_path):
    config = make_config(tmp_path, vllm_gpu_memory_utilization=0.6)
    with pytest.raises(ConfigError, match=r"vllm_gpu_memory_utilization=0.6 .* CPU.*set vllm_kv_cache_gb"):
        colocate_memory(config, "cpu")
    config = make_config(tmp_path, vllm_gpu_memory_utilization=0.6, vllm_kv_cache_gb=2.0)
    with pytest.raises(ConfigError, match=r"vllm_gpu_memory_utilization=0.6 and vllm_kv_cache_gb=2.0 both size"):
        colocate_memory(config, "cuda")
    assert colocate_memory(make_config(tmp_path, vllm_kv_cache_gb=2.0), "cuda") == (2.0, 0.3)


def test_online_dpo_memory_default_is_trls(tmp_path):
    theirs = import_trl_experimental("online_dpo").OnlineDPOConfig
    from posttrain.experimental.online_dpo import OnlineDPOConfig as ours

    default = {f.name: f.default for f in dataclasses.fields(theirs)}["vllm_gpu_memory_utilization"]
    assert {f.name: f.default for f in dataclasses.fields(ours)}["vllm_gpu_memory_utilization"] == default


# -- prompts beyond the model's context ---------------------------------------------------------------------------
def test_a_prompt_beyond_the_context_stops_before_training_naming_the_row(tiny_model_path, tmp_path):
    long = "one two three four five six seven eight nine ten " * 60  # over the tiny model's 512 positions
    data = prompt_dataset(8).map(lambda row, i: {"prompt": long if i == 3 else row["prompt"]}, with_indices=True)
    with pytest.raises(
        posttrain.errors.DataError,
        match=r"Row 3: the prompt is \d+ tokens, but the model's context is 512 tokens .*Set max_prompt_length "
        r"\(e\.g\. 504: .*data report counts the rows cut\), or drop the long rows",
    ):
        GRPOTrainer(tiny_model_path, _zero, args=make_config(tmp_path), train_dataset=data)
    config = make_config(tmp_path, max_prompt_length=600)
    with pytest.raises(posttrain.errors.DataError, match=r"Row 3: .*Lower max_prompt_length=600 below the context"):
        GRPOTrainer(tiny_model_path, _zero, args=config, train_dataset=data)
    trainer = GRPOTrainer(tiny_model_path, _zero, args=make_config(tmp_path, max_prompt_length=504), train_dataset=data)
    assert max(len(ids) for ids in trainer.train_dataset["prompt_ids"]) == 504


def _zero(completions, **kwargs):
    return [0.0] * len(completions)


def test_output_dir_is_every_configs_first_positional_field():
    """TRL's configs take output_dir first (`GMPOConfig("dummy")` in TRL's own tests): a field mixed in from another
    base (e.g. the Ray rollout fields) must not come before it."""
    import dataclasses
    import importlib
    import pkgutil

    import posttrain
    import posttrain.experimental as experimental

    modules = [posttrain] + [
        importlib.import_module(f"posttrain.experimental.{m.name}") for m in pkgutil.iter_modules(experimental.__path__)
    ]
    configs = {
        getattr(module, name)
        for module in modules
        for name in getattr(module, "__all__", [])
        if name.endswith("Config") and dataclasses.is_dataclass(getattr(module, name, None))
    }
    trained = {
        config.__name__: [f.name for f in dataclasses.fields(config) if f.init][0]
        for config in configs
        if "output_dir" in {f.name for f in dataclasses.fields(config)}
    }
    assert len(trained) >= 20 and set(trained.values()) <= {"output_dir"}, trained
