"""TRL's `trl.scripts.vllm_serve.ScriptArguments` and `build_command` on posttrain (posttrain/cli/vllm_serve.py):
the same fields and defaults as TRL 1.16's dataclass, and a command that passes every vLLM option TRL's command
passes, with the same value, to posttrain's server."""

import dataclasses
import importlib

import pytest
from _trl import import_trl

from posttrain.cli.vllm_serve import build_server_command
from posttrain.scripts.vllm_serve import ScriptArguments, build_command

# what TRL imposes on its own server (its NCCL weight engine, top-k log-probs, the routes of vLLM >= 0.30);
# posttrain's server pushes weights its own way (cli/vllm_serve.py)
TRL_ONLY = {"--max-logprobs", "--enable-scale-out"}


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
def test_build_command_passes_every_option_trl_passes(trl_vllm_serve, tmp_path, options, monkeypatch):
    # tests/vllm's stand-in package has no version for TRL's check (its --enable-scale-out is TRL_ONLY anyway)
    monkeypatch.setattr(trl_vllm_serve, "is_vllm_available", lambda *args, **kwargs: False)
    extra = ["--max-num-seqs", "16"]
    ours = build_command(ScriptArguments(model=str(tmp_path), **options), extra)
    theirs = trl_vllm_serve.build_command(trl_vllm_serve.ScriptArguments(model=str(tmp_path), **options), extra)
    mine, expected = _flags(ours), _flags(theirs)
    assert {k: v for k, v in expected.items() if k not in TRL_ONLY} == {
        k: mine.get(k, "absent") for k in expected if k not in TRL_ONLY
    }
    assert mine["--model"] == str(tmp_path) and ours[-2:] == extra
    # posttrain's server: its worker extension and sampling settings, the KV cache sized as TRL's is
    assert mine["--worker-extension-cls"] == "posttrain.generation.vllm_worker.PosttrainWorkerExtension"
    assert "--kv-cache-memory-bytes" not in mine and ("--max-model-len" in mine) == ("max_model_len" in options)


def test_build_command_is_the_cli_command_for_the_same_options(tmp_path):
    args = ScriptArguments(model=str(tmp_path), host="127.0.0.1", port=9001, max_model_len=1024, enforce_eager=True)
    cli, _ = build_server_command(
        [str(tmp_path), "--port", "9001", "--max-model-len", "1024", "--kv-cache-gb", "0"]
        + ["--gpu-memory-utilization", "0.9", "--weight-transfer", "nccl"]
    )
    assert build_command(args)[: len(cli)] == cli
