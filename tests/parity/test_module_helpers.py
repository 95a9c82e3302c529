"""The helpers posttrain gained at TRL's module paths (tests/parity/test_parity.py checks that every TRL 1.16 name
exists): each against TRL's own function on the same input where TRL is installed, or against an independent
reference."""

import argparse
import asyncio
import functools
import importlib
import os
import warnings

import pytest
import torch
from _trl import _vllm_hidden, trl_module
from transformers import AutoModelForCausalLM


def _trl(path: str):
    trl_module("trl")
    with warnings.catch_warnings(), _vllm_hidden():
        warnings.simplefilter("ignore")
        os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
        return trl_module(path)


def test_row_cleaning_matches_trl():
    from posttrain.trainer.utils import remove_none_values, strip_images_from_messages

    theirs = _trl("trl.trainer.utils")
    row = [{"a": {"aa": None, "ab": 1}, "b": "s", "c": [None, 2, {"d": None}]}, None]
    assert (
        remove_none_values(row)
        == theirs.remove_none_values(row)
        == [{"a": {"ab": 1}, "b": "s", "c": [None, 2, {}]}, None]
    )
    messages = [
        {"role": "user", "content": [{"type": "image", "image": object()}, {"type": "text", "text": "hi"}]},
        {"role": "assistant", "content": "ok"},
    ]
    ours = strip_images_from_messages(messages)
    assert ours == theirs.strip_images_from_messages(messages)
    assert ours[0]["content"][0] == {"type": "image"} and "image" in messages[0]["content"][0]  # input untouched


def test_is_async_callable_and_the_daemon_loop():
    from posttrain.trainer.utils import is_async_callable, shutdown_event_loop_in_daemon, start_event_loop_in_daemon

    async def coroutine(x):
        return x + 1

    class AsyncCall:
        async def __call__(self, x):
            return x

    forms = [coroutine, functools.partial(coroutine, 1), AsyncCall(), len, lambda x: x, AsyncCall]
    assert [is_async_callable(f) for f in forms] == [True, True, True, False, False, False]
    thread, loop, ready = start_event_loop_in_daemon("test-loop")
    assert ready.wait(5) and thread.daemon and thread.name == "test-loop"
    assert asyncio.run_coroutine_threadsafe(coroutine(41), loop).result(5) == 42
    shutdown_event_loop_in_daemon(thread, loop)
    assert not thread.is_alive() and loop.is_closed()
    shutdown_event_loop_in_daemon(None, None)


def test_ensure_master_addr_port(monkeypatch):
    from posttrain.trainer import ensure_master_addr_port

    monkeypatch.delenv("MASTER_ADDR", raising=False)
    monkeypatch.setenv("MASTER_PORT", "auto")
    ensure_master_addr_port()
    assert os.environ["MASTER_ADDR"] == "localhost" and 0 < int(os.environ["MASTER_PORT"]) < 65536
    monkeypatch.setenv("MASTER_ADDR", "10.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "1234")
    ensure_master_addr_port("other", 99)
    assert (os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"]) == ("10.0.0.1", "1234")


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_selective_log_softmax_and_entropy(temperature):
    from posttrain.trainer.utils import selective_log_softmax_and_entropy

    torch.manual_seed(0)
    logits = torch.randn(2, 5, 11, requires_grad=True)
    index = torch.randint(0, 11, (2, 5))
    row_mask = torch.tensor([[1, 1, 0, 1, 1], [0, 1, 1, 1, 1]])
    logps, entropy = selective_log_softmax_and_entropy(logits, index, temperature=temperature, row_mask=row_mask)
    ref = torch.log_softmax(logits.double() / temperature, -1)
    want_logps = ref.gather(-1, index.unsqueeze(-1)).squeeze(-1) * row_mask
    want_entropy = -(ref.exp() * ref).sum(-1) * row_mask
    torch.testing.assert_close(logps.double(), want_logps, atol=1e-6, rtol=0)
    torch.testing.assert_close(entropy.double(), want_entropy, atol=1e-6, rtol=0)
    theirs = _trl("trl.trainer.utils").selective_log_softmax_and_entropy(
        logits, index, temperature=temperature, row_mask=row_mask
    )
    torch.testing.assert_close(logps, theirs[0].float(), atol=1e-5, rtol=0)
    torch.testing.assert_close(entropy, theirs[1].float(), atol=1e-5, rtol=0)
    logps.sum().backward()
    assert logits.grad[0, 2].abs().sum() == 0  # a masked row gets no gradient


def test_sequence_tensor_helpers_match_trl():
    from posttrain.experimental.utils import first_true_indices, pad_to_length, truncate_right

    theirs = _trl("trl.experimental.utils")
    bools = torch.tensor([[False, True, True], [False, False, False], [True, False, False]])
    assert first_true_indices(bools).tolist() == theirs.first_true_indices(bools).tolist() == [1, 3, 0]
    x = torch.tensor([[1, 2], [3, 4]])
    assert torch.equal(pad_to_length(x, 4, -1), theirs.pad_to_length(x, 4, -1))
    assert torch.equal(pad_to_length(x, 3, 0, dim=0), theirs.pad_to_length(x, 3, 0, dim=0))
    ids = torch.tensor([[5, 2, 7, 8], [5, 6, 7, 8], [9, 9, 3, 2]])
    for got, want in zip(truncate_right(ids, [2, 3], 0), theirs.truncate_right(ids, [2, 3], 0)):
        assert torch.equal(got, want)
    assert truncate_right(ids, [2, 3], 0)[0].tolist() == [[5, 2, 0, 0], [5, 6, 7, 8], [9, 9, 3, 0]]


def test_self_distillation_divergence_and_tail_bucket_match_trl():
    from posttrain.experimental.sdft.loss_utils import add_tail_bucket, compute_divergence

    theirs = _trl("trl.experimental.sdft.loss_utils")
    torch.manual_seed(0)
    student, teacher = torch.log_softmax(torch.randn(3, 4, 9), -1), torch.log_softmax(torch.randn(3, 4, 9), -1)
    for alpha in (0.0, 0.3, 1.0):
        torch.testing.assert_close(
            compute_divergence(student, teacher, alpha), theirs.compute_divergence(student, teacher, alpha)
        )
    top = torch.log_softmax(torch.randn(2, 6), -1)[:, :3]
    torch.testing.assert_close(add_tail_bucket(top), theirs.add_tail_bucket(top))
    torch.testing.assert_close(add_tail_bucket(top).exp().sum(-1), torch.ones(2))


def test_openai_conversions_match_trl():
    from PIL import Image

    from posttrain.generation.vllm_client import parse_logprobs, pil_to_base64, to_openai_messages

    theirs = _trl("trl.generation.vllm_client")
    image = Image.new("RGB", (2, 2), (10, 20, 30))
    assert pil_to_base64(image) == theirs.pil_to_base64(image)
    messages = [{"role": "user", "content": [{"type": "image", "image": image}, {"type": "text", "text": "x"}]}]
    assert to_openai_messages(messages) == theirs.to_openai_messages(messages)
    completions = {
        "tokens": ["token_id:5", "token_id:7"],
        "token_logprobs": [-0.5, float("nan")],
        "top_logprobs": [{"token_id:3": -0.1}, {"token_id:7": float("nan"), "token_id:1": -2.0}],
    }
    chat = {
        "content": [
            {"token": "token_id:4", "logprob": -1.0, "top_logprobs": [{"token": "token_id:2", "logprob": -0.2}]}
        ]
    }
    for choices in ([completions, chat], [None]):
        assert parse_logprobs(choices) == theirs.parse_logprobs(choices)
    assert parse_logprobs([completions])[1][0][0] == [3, 5]  # most probable first, the sampled token included


def test_extract_logprobs_matches_trl():
    from types import SimpleNamespace as NS

    from posttrain.generation.vllm_generation import extract_logprobs

    theirs = _trl("trl.generation.vllm_generation")
    position = {4: NS(logprob=-1.5, rank=2), 9: NS(logprob=-0.1, rank=1)}
    outputs = [
        NS(outputs=[NS(logprobs=[position, {3: NS(logprob=float("nan"), rank=1)}])]),
        NS(outputs=[NS(logprobs=[position])]),
    ]
    assert extract_logprobs(outputs) == theirs.extract_logprobs(outputs)
    assert extract_logprobs(outputs)[1][0] == [[9, 4], [3]]
    assert extract_logprobs([NS(outputs=[NS(logprobs=None)])]) == (None, None)


def test_activation_offloading_keeps_gradients_and_spares_the_head(tiny_model_path):
    from posttrain.models import get_act_offloading_ctx_manager
    from posttrain.models.activation_offloading import OffloadActivations

    model = AutoModelForCausalLM.from_pretrained(tiny_model_path)
    batch = {"input_ids": torch.tensor([[1, 5, 9, 12, 3]]), "labels": torch.tensor([[1, 5, 9, 12, 3]])}
    model(**batch).loss.backward()
    plain = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    seen = []
    manager = get_act_offloading_ctx_manager(model, min_offload_size=0)
    with manager:
        loss = model(**batch).loss
    loss.backward()
    for got, want in zip((p.grad for p in model.parameters()), plain):
        torch.testing.assert_close(got, want)
    # on a CPU nothing moves; a tensor "on an accelerator" (a meta tensor here) is packed to the host
    offload = OffloadActivations(min_offload_size=8)
    with offload:
        weight = torch.ones(4, requires_grad=True)
        (weight * torch.ones(4)).sum().backward()
    seen.append(offload.offloaded)
    assert seen == [0]


def test_selective_checkpointing_gives_the_same_gradients(tiny_model_path):
    from posttrain.models import enable_selective_activation_checkpointing

    batch = {"input_ids": torch.tensor([[1, 5, 9, 12, 3, 7]]), "labels": torch.tensor([[1, 5, 9, 12, 3, 7]])}
    grads = []
    for selective in (False, True):
        model = AutoModelForCausalLM.from_pretrained(tiny_model_path)
        if selective:
            enable_selective_activation_checkpointing(model)
        model.train()
        model(**batch).loss.backward()
        grads.append([p.grad for p in model.parameters()])
    for got, want in zip(*grads):
        torch.testing.assert_close(got, want)
    with pytest.raises(ValueError, match="_no_split_modules"):
        enable_selective_activation_checkpointing(torch.nn.Linear(2, 2))


def test_frozen_placement_and_backend_without_a_sharding_engine():
    from accelerate import Accelerator

    from posttrain.distributed import DistributedBackend
    from posttrain.errors import ConfigError
    from posttrain.models import prepare_deepspeed, prepare_fsdp

    accelerator = Accelerator(cpu=True)
    for prepare, plugin in ((prepare_deepspeed, "deepspeed_plugin"), (prepare_fsdp, "fsdp_plugin")):
        with pytest.raises(ConfigError, match=plugin):
            prepare(torch.nn.Linear(2, 2), accelerator)
    backend = DistributedBackend(accelerator)
    assert (backend.zero_stage, backend.fsdp_version, backend.is_zero3, backend.is_fsdp) == (0, None, False, False)
    with backend.gather_params([]), backend.summon_full_params(torch.nn.Linear(2, 2)):
        pass


def test_profiling_times_the_block_and_the_method():
    from types import SimpleNamespace as NS

    from posttrain.extras.profiling import ProfilingContext, profiling_decorator

    with ProfilingContext("block", report_to=[]) as context:
        sum(range(1000))
    assert context.duration is not None and context.duration >= 0

    class Trainer:
        args = NS(report_to="none")
        accelerator = NS(is_main_process=True)
        state = NS(global_step=3)

        @profiling_decorator
        def step(self, x):
            return x * 2

    assert Trainer().step(4) == 8 and Trainer.step.__name__ == "step"


def test_cli_commands_and_vllm_serve_parser():
    from posttrain.cli.commands import get_commands
    from posttrain.cli.commands.base import CommandContext
    from posttrain.scripts.vllm_serve import make_parser

    theirs = _trl("trl.cli.commands")
    assert [c.name for c in get_commands()] == [c.name for c in theirs.get_commands()]
    assert CommandContext(["posttrain", "dpo", "--x", "1"]).argv_after("dpo") == ["--x", "1"]
    subparsers = argparse.ArgumentParser(prog="posttrain").add_subparsers(dest="command")
    for command in get_commands():
        if command.name != "vllm-serve":
            command.register(subparsers)
    parser = make_parser(subparsers)
    args = parser.parse_args(["--model", "m", "--port", "9000"])  # TRL's spelling
    assert (args.model, args.port) == ("m", 9000)
    assert make_parser(prog="trl vllm-serve").prog == "trl vllm-serve"


def test_git_commit_hash_and_model_helpers(tiny_model_path):
    from posttrain.scripts.utils import get_git_commit_hash
    from posttrain.trainer.utils import create_model_from_path, get_config_model_id

    commit = get_git_commit_hash("posttrain")
    assert commit is None or len(commit) == 40
    assert get_git_commit_hash("torch") is None and get_git_commit_hash("no_such_package_here") is None
    model = create_model_from_path(str(tiny_model_path), dtype="bfloat16")
    assert model.dtype == torch.bfloat16 and get_config_model_id(model.config) == str(tiny_model_path)
    importlib.import_module("posttrain.scripts.env").print_env  # noqa: B018
