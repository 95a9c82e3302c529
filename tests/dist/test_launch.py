"""Launch checks that need no second process (default suite): a multi-process accelerate default config without a
launcher stops with a ConfigError saying how to launch; under a launcher on a CPU-only machine the config trains on
the CPU over gloo (without it each process would silently train alone)."""

import pytest
import torch

from posttrain import SFTConfig
from posttrain.errors import ConfigError


def _config(tmp_path):
    return SFTConfig(output_dir=str(tmp_path / "out"), report_to="none")


@pytest.fixture()
def default_config(tmp_path, monkeypatch):
    import accelerate.commands.config.config_args as config_args

    path = tmp_path / "default_config.yaml"
    monkeypatch.setattr(config_args, "default_config_file", str(path))
    for name in ("LOCAL_RANK", "WORLD_SIZE", "RANK", "POSTTRAIN_SINGLE_PROCESS"):
        monkeypatch.delenv(name, raising=False)
    return path


def test_multiprocess_default_config_without_a_launcher_is_refused(tmp_path, default_config, monkeypatch):
    default_config.write_text("distributed_type: MULTI_GPU\nnum_processes: 2\n")
    with pytest.raises(ConfigError, match=r"asks for 2 processes.*accelerate launch"):
        _config(tmp_path)
    monkeypatch.setenv("POSTTRAIN_SINGLE_PROCESS", "1")
    assert _config(tmp_path).world_size == 1


def test_single_process_or_no_default_config_is_accepted(tmp_path, default_config):
    assert _config(tmp_path).world_size == 1  # no file
    default_config.write_text("distributed_type: 'NO'\nnum_processes: 1\n")
    assert _config(tmp_path).world_size == 1


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU fallback applies only without an accelerator")
def test_a_launched_process_on_a_cpu_trains_over_gloo(monkeypatch):
    from posttrain.runtime.distributed import use_gloo_on_cpu

    class Args:
        use_cpu, ddp_backend = False, None

    args = Args()
    use_gloo_on_cpu(args)
    assert args.use_cpu and args.ddp_backend == "gloo"
    args.ddp_backend = "mpi"  # a backend the user chose is kept
    use_gloo_on_cpu(args)
    assert args.ddp_backend == "mpi"
