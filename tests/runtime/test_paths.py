"""Which kernels a run gets (posttrain/runtime/paths.py): posttrain's own fast paths only on the devices they were
measured on (runtime/measured.py) unless the user turns them on, and the ecosystem's defaults elsewhere; the trainers
follow the choice (segment attention, the fast forward, the Adam layout, fused layers) and log it."""

import logging

import pytest
import torch

from posttrain.errors import ConfigError
from posttrain.runtime.measured import MEASURED
from posttrain.runtime.paths import choose_paths, fast_path_on, forced_paths

NONE = frozenset()
FLASH = frozenset({"flash_attn"})
LIGER = frozenset({"liger_kernel"})
OWN = ("fused_layers", "segment_attention", "fast_forward", "adam_layout")


def test_every_fast_path_declares_its_devices():
    assert set(MEASURED) == set(OWN)
    assert all(devices and devices <= {"cpu", "cuda", "mps", "xpu"} for devices in MEASURED.values())


def test_cpu_gets_posttrains_own_paths_trls_bf16_and_no_checkpointing():
    paths = choose_paths("cpu", kernels=NONE, forced={})
    assert paths.fast == dict.fromkeys(OWN, True)
    assert (paths.attention, paths.padding_free) == ("sdpa (default)", "segment attention")
    assert paths.bf16  # TRL 1.16 turns bf16 on on any device, a CPU included
    assert not (paths.gradient_checkpointing or paths.liger or paths.torch_compile)
    assert not choose_paths("cpu", bf16=False, kernels=NONE, forced={}).bf16


@pytest.mark.parametrize("kernels", [NONE, FLASH, FLASH | LIGER])
def test_cuda_gets_the_ecosystems_defaults(kernels):
    paths = choose_paths("cuda", kernels=kernels, forced={})
    assert paths.fast == dict.fromkeys(OWN, False)  # measured on CPU only
    assert paths.attention == "sdpa (default)"  # installed FlashAttention is not picked for the user (as TRL)
    assert paths.padding_free == "sdpa with position ids"
    assert paths.bf16 and paths.gradient_checkpointing and not paths.liger and not paths.torch_compile


def test_cuda_with_flash_attention_named_uses_its_varlen_path():
    paths = choose_paths("cuda", attn_implementation="flash_attention_2", kernels=FLASH, forced={})
    assert (paths.attention, paths.padding_free) == ("flash_attention_2", "flash-attention varlen")
    paths = choose_paths("cuda", attn_implementation="flash_attention_3", kernels=frozenset({"flash_attn_3"}))
    assert paths.padding_free == "flash-attention varlen"


@pytest.mark.parametrize("device", ["cpu", "mps"])
def test_flash_attention_off_cuda_or_uninstalled_is_refused(device):
    with pytest.raises(ConfigError, match="flash_attention_2.*needs a CUDA GPU.*attn_implementation='sdpa'"):
        choose_paths(device, attn_implementation="flash_attention_2", kernels=FLASH)
    with pytest.raises(ConfigError, match=r"needs the flash_attn package \(pip install flash-attn\)"):
        choose_paths("cuda", attn_implementation="flash_attention_2", kernels=NONE)


@pytest.mark.parametrize("device", ["cpu", "cuda", "mps"])
def test_liger_replaces_the_fused_layers_and_needs_its_package(device):
    paths = choose_paths(device, use_liger_kernel=True, kernels=LIGER, forced={})
    assert paths.liger and not paths.fast["fused_layers"]
    with pytest.raises(ConfigError, match="use_liger_kernel=True needs liger-kernel: pip install liger-kernel"):
        choose_paths(device, use_liger_kernel=True, kernels=FLASH)


def test_mps_gets_no_own_paths_and_trls_bf16_but_no_checkpointing():
    paths = choose_paths("mps", kernels=NONE, forced={})
    assert paths.fast == dict.fromkeys(OWN, False) and paths.bf16 and not paths.gradient_checkpointing
    assert paths.padding_free == "sdpa with position ids"


def test_the_user_turns_paths_on_and_off():
    assert forced_paths("") == {}
    assert forced_paths("fused_layers, -adam_layout") == {"fused_layers": True, "adam_layout": False}
    assert forced_paths("all") == dict.fromkeys(OWN, True) and forced_paths("none") == dict.fromkeys(OWN, False)
    with pytest.raises(ConfigError, match="POSTTRAIN_FAST_PATHS='fused' names 'fused'.*adam_layout, fast_forward"):
        forced_paths("fused")
    on = choose_paths("cuda", kernels=NONE, forced=forced_paths("segment_attention,fast_forward"))
    assert on.fast == {"fused_layers": False, "segment_attention": True, "fast_forward": True, "adam_layout": False}
    assert on.padding_free == "segment attention"
    off = choose_paths("cpu", kernels=NONE, forced=forced_paths("none"))
    assert not any(off.fast.values()) and off.padding_free == "sdpa with position ids"
    # a config's explicit fused_layers wins over the device's default, either way
    assert choose_paths("cuda", fused_layers=True, forced={}).fast["fused_layers"]
    assert not choose_paths("cpu", fused_layers=False, forced={}).fast["fused_layers"]
    assert not choose_paths("cpu", torch_compile=True, forced={}).fast["segment_attention"]


def test_the_describe_line_names_device_and_every_choice():
    line = choose_paths("cuda", use_liger_kernel=True, kernels=LIGER, forced={}).describe()
    assert line.startswith("Device cuda: posttrain paths: fused_layers off, segment_attention off")
    assert "liger on" in line and "bf16 on" in line and "gradient checkpointing on" in line


def test_posttrain_env_names_the_device_and_paths(monkeypatch):
    from posttrain.cli.environment import paths_report

    assert paths_report("none, CPU only (2 cores)").startswith("Device cpu: posttrain paths: fused_layers on")
    assert paths_report("CUDA 13.0: 1 x NVIDIA H100").startswith("Device cuda: posttrain paths: fused_layers off")
    monkeypatch.setenv("POSTTRAIN_FAST_PATHS", "bogus")
    assert paths_report("Apple MPS").startswith("error: POSTTRAIN_FAST_PATHS='bogus'")


def test_env_var_reaches_the_fast_forward_and_adam_layout(monkeypatch, tokenizer):
    from posttrain.models.fast_forward import fast_forward
    from posttrain.models.tiny import build_tiny_model
    from posttrain.training.optimizer_state import allocate_adam_states_together

    model = build_tiny_model(tokenizer)
    with torch.no_grad():  # (the fast forward is a no-grad path)
        assert fast_path_on("fast_forward", "cpu", {}) and fast_forward(model) is not None
    assert allocate_adam_states_together(torch.optim.AdamW(model.parameters()))
    monkeypatch.setenv("POSTTRAIN_FAST_PATHS", "-fast_forward,-adam_layout")
    with torch.no_grad():
        assert fast_forward(model) is None
    assert not allocate_adam_states_together(torch.optim.AdamW(model.parameters()))


def test_trainer_follows_and_logs_the_choice(monkeypatch, tmp_path, tiny_model_path, caplog):
    from datasets import Dataset

    from posttrain.trainers.sft import SFTConfig, SFTTrainer

    data = Dataset.from_list([{"text": "the cat sat"}] * 4)

    def trainer(**kw):
        args = SFTConfig(output_dir=str(tmp_path), use_cpu=True, report_to="none", max_steps=1, **kw)
        return SFTTrainer(tiny_model_path, args=args, train_dataset=data)

    with caplog.at_level(logging.INFO, logger="posttrain"):
        first = trainer(padding_free=True)
    assert first.args.fused_layers is True and first._segment_attention
    line = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("Device "))
    assert line.startswith("Device cpu: posttrain paths: fused_layers on, segment_attention on")
    monkeypatch.setenv("POSTTRAIN_FAST_PATHS", "none")
    second = trainer(padding_free=True)
    assert second.args.fused_layers is False and not second._segment_attention
    with pytest.raises(ConfigError, match="flash_attention_2"):
        trainer(model_init_kwargs={"attn_implementation": "flash_attention_2"})
