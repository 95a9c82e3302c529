"""The generation process's idle cores lent to the update (posttrain/online/producers/core_lending.py): borrowed at the
layer boundaries of the forward and backward while the flag is down, given back as soon as it is up and when the
update ends, the gradients those of a run that never borrows, and the generation process's flag up exactly while
it samples."""

from __future__ import annotations

import threading
import time
from multiprocessing import Pipe
from types import SimpleNamespace

import torch
from transformers import AutoModelForCausalLM

from posttrain.online.producers import core_lending, generation_worker
from posttrain.online.producers.core_lending import CoreLender, decoder_layers
from posttrain.online.producers.generation_worker import Request
from posttrain.runtime.cores import CoreSplit

SPLIT = CoreSplit(generation=(0,), training=(1,), generation_threads=1, training_threads=1)


def lender_with_record(monkeypatch, limit: int = 2):
    pins = []
    monkeypatch.setattr(core_lending, "pin_process", lambda cpus: pins.append(tuple(cpus)))
    busy = SimpleNamespace(value=0)
    return CoreLender(SPLIT, busy, threads=1, limit=limit), busy, pins


def gradients(model, ids):
    model.zero_grad()
    model(input_ids=ids, labels=ids).loss.backward()
    return {name: p.grad.clone() for name, p in model.named_parameters()}


def test_borrows_while_idle_gives_back_when_sampling_starts_and_after_the_update(monkeypatch, tiny_model_path):
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path)
    layers = decoder_layers(model)
    assert len(layers) == model.config.num_hidden_layers >= 2
    ids = torch.tensor([[1, 5, 9, 4, 7, 2]])
    expected = gradients(model, ids)  # never borrowing
    lender, busy, pins = lender_with_record(monkeypatch)
    threads_seen = []
    for layer in layers:  # the threads each layer's forward ran with
        layer.register_forward_hook(lambda module, args, output: threads_seen.append(torch.get_num_threads()))
    # sampling starts when the second layer's forward begins (registered first, so the lender looks after it),
    # and ends when the backward begins
    layers[1].register_forward_pre_hook(lambda module, args: setattr(busy, "value", 1))
    threads_before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with lender.update(model):
            model.zero_grad()
            loss = model(input_ids=ids, labels=ids).loss
            loss.register_hook(lambda grad: setattr(busy, "value", 0))
            assert torch.get_num_threads() == 1  # given back at the second layer, still so after the forward
            loss.backward()
            assert torch.get_num_threads() == 2  # borrowed again at the backward's first layer boundary
        assert torch.get_num_threads() == 1  # and given back when the update ends, though the flag is down
        got = {name: p.grad for name, p in model.named_parameters()}
    finally:
        torch.set_num_threads(threads_before)
    # the first layer ran on two threads (borrowed on entry), the others on one (the second's look saw the flag up)
    assert threads_seen[0] == 2 and set(threads_seen[1:]) == {1}
    assert pins == [(0, 1), (1,), (0, 1), (1,)]
    assert lender.take_lent_seconds() > 0 and lender.take_lent_seconds() == 0
    for name, grad in expected.items():
        torch.testing.assert_close(got[name], grad, rtol=1e-5, atol=1e-6, msg=name)


def test_never_borrows_beyond_the_threads_the_run_was_given(monkeypatch, tiny_model_path):
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path)
    lender, busy, pins = lender_with_record(monkeypatch, limit=1)  # OMP_NUM_THREADS=1: no thread to add
    assert not lender.useful
    with lender.update(model):
        model(input_ids=torch.tensor([[1, 2, 3]])).logits.sum().backward()
    assert pins == [] and not lender.lending


def test_the_generation_process_flag_is_up_exactly_while_it_samples(monkeypatch):
    busy = SimpleNamespace(value=0)
    seen = []

    class Server:
        def __init__(self, model, weights, settings):
            pass

        def generate(self, request):
            seen.append((request.id, busy.value))
            if request.id == 1:
                raise ValueError("sampling failed")
            return request.id

    monkeypatch.setattr(generation_worker, "GenerationServer", Server)
    monkeypatch.setattr(generation_worker.torch, "set_num_threads", lambda threads: None)
    settings = SimpleNamespace(cpus=None, threads=1)
    requests_out, requests_in = Pipe(duplex=False)
    results_out, results_in = Pipe(duplex=False)
    worker = threading.Thread(
        target=generation_worker.serve, args=(None, None, settings, requests_out, results_in, busy)
    )
    worker.start()
    requests_in.send(Request(0, [[1]], 1, [0], None))
    assert results_out.recv() == 0
    deadline = time.monotonic() + 5
    while busy.value and time.monotonic() < deadline:  # lowered just after the answer is queued
        time.sleep(0.01)
    worker_idle = busy.value
    requests_in.send(Request(1, [[1]], 1, [0], None))
    failure = results_out.recv()
    requests_in.send(None)
    worker.join(timeout=10)
    assert not worker.is_alive()
    assert seen == [(0, 1), (1, 1)]
    assert worker_idle == 0 and busy.value == 0  # down between requests and after a failure
    assert "sampling failed" in failure.error
