"""Asynchronous generation in a process of its own (posttrain/online/producers/process.py, generation_worker.py,
weights/shared_memory.py): k = 0 is bitwise the synchronous run, resuming with rounds in flight is exact, a killed
generation process is restarted without losing a round, the two processes get their own cores, in-flight updates
swap weights between decode steps with per-token versions and log-probs, and max_staleness drops old episodes."""

from __future__ import annotations

import importlib
import json
import os
import re
import signal
import threading
import time

import pytest
import torch
from _rollouts import record_rollouts
from test_engine import stopping_model
from test_producers_thread import UNTIMED, StopAfter, grpo, losses
from transformers import AutoModelForCausalLM, DynamicCache, TrainerCallback

from posttrain.errors import ConfigError
from posttrain.generation import SamplingParams
from posttrain.models.reference import copy_model, freeze
from posttrain.online.producers import process as process_rollouts
from posttrain.online.producers.generation_worker import GenerationServer, Request, WorkerSettings
from posttrain.online.producers.process import ProcessRolloutProducer
from posttrain.online.producers.thread import ThreadRolloutProducer
from posttrain.online.weights.shared_memory import GenerationProcessDied, SharedWeights
from posttrain.runtime.cores import CoreSplit
from posttrain.training.checkpoints import TRAINER_STATE_FILE

PROCESS = dict(async_generation_process=True)


@pytest.fixture
def same_threads(monkeypatch):
    """Both processes on every CPU with the test's thread count: the kernels, and so the numbers, of a
    synchronous run (pinning is tested on its own)."""
    cpus = tuple(sorted(os.sched_getaffinity(0)))
    split = CoreSplit(cpus, cpus, torch.get_num_threads(), torch.get_num_threads())
    monkeypatch.setattr(process_rollouts, "generation_core_split", lambda *args: split)


def assert_same_parameters(one, other, exact: bool = True):
    expected = dict(one.model.named_parameters())
    for name, value in other.model.named_parameters():
        if exact:
            assert torch.equal(value, expected[name]), name
        else:
            torch.testing.assert_close(value, expected[name], atol=1e-6, rtol=0, msg=name)


@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16"])
def test_zero_rounds_ahead_in_a_process_is_bitwise_the_synchronous_run(tmp_path, tiny_model_path, same_threads, bf16):
    """With bf16 the trainer's forward runs under autocast: the process's copy must sample and score under the
    same one (its weights stay float32)."""
    sync = grpo(stopping_model(tiny_model_path), tmp_path / "sync", bf16=bf16)
    sync_rollouts = record_rollouts(sync)
    sync.train()
    ahead = grpo(stopping_model(tiny_model_path), tmp_path / "process", async_generation_rounds=0, bf16=bf16, **PROCESS)
    assert isinstance(ahead.rollout_producer, ProcessRolloutProducer)
    ahead_rollouts = record_rollouts(ahead)
    ahead.train()
    for one, other in zip(sync_rollouts, ahead_rollouts, strict=True):
        assert torch.equal(one.completion_ids, other.completion_ids)
    logged = [h for h in ahead.state.log_history if "loss" in h]
    assert all(h["sampler/logp_diff_max"] == 0.0 and h["sample/staleness_max"] == 0.0 for h in logged)
    assert losses(ahead) == losses(sync)
    assert_same_parameters(sync, ahead)


@pytest.mark.parametrize(
    "settings",
    [dict(async_generation_rounds=1), dict(async_generation_rounds=2, vllm_sync_steps=2)],
    ids=["k1", "k2_sync2"],
)
def test_resume_with_rounds_in_flight_in_a_process_is_exact(tmp_path, tiny_model_path, same_threads, settings):
    """Without in-flight updates a round's weights are fixed when it is submitted: the resumed run is the
    uninterrupted one."""
    common = dict(
        max_steps=6,
        save_strategy="steps",
        save_steps=3,
        per_device_train_batch_size=4,
        num_generations=2,
        async_inflight_weight_updates=False,
        **PROCESS,
        **settings,
    )
    straight = grpo(tiny_model_path, tmp_path / "straight", **common)
    straight.train()
    interrupted = grpo(tiny_model_path, tmp_path / "run", callbacks=[StopAfter(3)], **common)
    interrupted.train()
    resumed = grpo(tiny_model_path, tmp_path / "run", **common)
    resumed.train(resume_from_checkpoint=True)
    assert resumed.state.global_step == 6
    assert_same_parameters(straight, resumed, exact=False)
    want = {h["step"]: h for h in straight.state.log_history if "loss" in h and h["step"] > 3}
    got = {h["step"]: h for h in resumed.state.log_history if "loss" in h and h["step"] > 3}
    assert sorted(got) == sorted(want) == [4, 5, 6]
    for step, row in want.items():
        for key in (k for k in row if not k.startswith(UNTIMED) and k != "async/generation_restarts"):
            assert got[step][key] == pytest.approx(row[key], rel=1e-5, abs=1e-6), (step, key)


def test_resume_with_in_flight_updates_trains_on_the_saved_rounds(tmp_path, tiny_model_path):
    common = dict(max_steps=5, save_strategy="steps", save_steps=3, async_generation_rounds=2, **PROCESS)
    interrupted = grpo(tiny_model_path, tmp_path / "run", callbacks=[StopAfter(3)], **common)
    interrupted.train()
    saved = torch.load(tmp_path / "run" / "checkpoint-3" / TRAINER_STATE_FILE, weights_only=False)["async_rollouts"]
    assert sorted(saved["rounds"]) == [3, 4]
    resumed = grpo(tiny_model_path, tmp_path / "run", **common)
    rollouts = record_rollouts(resumed)
    resumed.train(resume_from_checkpoint=True)
    for rollout in rollouts:
        episodes, _ = saved["rounds"][rollout.round]
        for row, episode in enumerate(episodes):
            assert rollout.completion_ids[row, : len(episode.token_ids)].tolist() == episode.token_ids
            assert rollout.episodes[row]["token_versions"] == episode.info["token_versions"]


class KillAfterSending:
    """Kills the generation process right after it was sent request `request_id` (which it then never answers)."""

    def __init__(self, producer: ProcessRolloutProducer, request_id: int):
        self.producer, self.request_id, self.killed = producer, request_id, False
        self.send = producer._send
        producer._send = self

    def __call__(self, request):
        self.send(request)
        if request.id == self.request_id and not self.killed:
            os.kill(self.producer.process.pid, signal.SIGKILL)
            self.killed = True


def test_a_killed_generation_process_is_restarted_and_no_round_is_lost(tmp_path, tiny_model_path, same_threads, caplog):
    common = dict(max_steps=4, async_generation_rounds=1, async_inflight_weight_updates=False, **PROCESS)
    plain = grpo(tiny_model_path, tmp_path / "plain", **common)
    plain.train()
    faulty = grpo(tiny_model_path, tmp_path / "faulty", **common)
    killer = KillAfterSending(faulty.rollout_producer, request_id=2)
    with caplog.at_level("WARNING", logger="posttrain"):
        faulty.train()
    assert killer.killed
    assert re.search(r"exited \(code -9\); restarting it and resending [12] round\(s\)", caplog.text)
    restarts = [h["async/generation_restarts"] for h in faulty.state.log_history if "loss" in h]
    assert sum(restarts) == 1
    assert losses(faulty) == losses(plain)
    assert_same_parameters(plain, faulty)


def hold_the_lock(weights: SharedWeights, held) -> None:
    """A generation process that takes the weights' lock and never lets it go (until it is killed)."""
    weights.lock.acquire()
    held.set()
    time.sleep(600)


def test_a_process_killed_holding_the_weights_lock_never_blocks_the_trainer():
    """The race CI once hung on: SIGKILL lands while the generation process holds the lock. Every trainer-side
    read of the table, the reset, and publishing after it must return, not wait for a lock no one will release."""
    context = torch.multiprocessing.get_context("spawn")
    weights = SharedWeights(torch.nn.Linear(3, 2), 3, context)
    params = [torch.ones(2, 3), torch.full((2,), 2.0)]
    weights.publish(params, version=4, pinned=set())
    held = context.Event()
    holder = context.Process(target=hold_the_lock, args=(weights, held), daemon=True)
    holder.start()
    assert held.wait(timeout=120)
    os.kill(holder.pid, signal.SIGKILL)
    holder.join()
    seen: list = []

    def trainer_side():
        seen.append(weights.slot_of(4))
        with pytest.raises(GenerationProcessDied):
            weights.publish(params, version=5, pinned=set(), alive=lambda: False)
        weights.reset_table(context)
        seen.append(weights.publish([2 * p for p in params], version=5, pinned=set()))
        seen.append((weights.slot_of(4), weights.slot_of(5)))

    thread = threading.Thread(target=trainer_side, daemon=True)
    thread.start()
    thread.join(timeout=60)
    assert not thread.is_alive(), "the trainer waited for the lock of a dead process"
    assert seen == [0, 1, (0, 1)]
    assert torch.equal(weights.views(1)[1], torch.full((2,), 4.0))


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two CPUs")
def test_each_process_runs_on_its_own_cores_and_training_gets_them_back(tmp_path, tiny_model_path, monkeypatch):
    cpus = sorted(os.sched_getaffinity(0))
    split = CoreSplit((cpus[0],), tuple(cpus[1:]), 1, len(cpus) - 1)
    monkeypatch.setattr(process_rollouts, "generation_core_split", lambda *args: split)
    threads_before = torch.get_num_threads()

    class Look(TrainerCallback):
        seen = None

        def on_step_end(self, args, state, control, **kwargs):
            process = trainer.rollout_producer.process
            Look.seen = (os.sched_getaffinity(process.pid), os.sched_getaffinity(0), torch.get_num_threads())

    trainer = grpo(tiny_model_path, tmp_path, callbacks=[Look()], max_steps=2, async_generation_rounds=1, **PROCESS)
    trainer.train()
    assert Look.seen == ({cpus[0]}, set(cpus[1:]), min(len(cpus) - 1, threads_before))
    assert sorted(os.sched_getaffinity(0)) == cpus and torch.get_num_threads() == threads_before
    assert trainer.rollout_producer.process is None


# -- in-flight weight updates, inside one process ------------------------------------------------------------
def server_and_weights(model_path, tokenizer, max_tokens: int, in_flight: bool = True, exact_logps: bool = True):
    model = freeze(copy_model(stopping_model(model_path, num_stops=0)))
    weights = SharedWeights(model, 3, torch.multiprocessing.get_context("spawn"))
    settings = WorkerSettings(
        pad_token_id=tokenizer.pad_token_id,
        stop_ids=(tokenizer.eos_token_id,),
        sampling=SamplingParams(max_tokens=max_tokens, temperature=0.9),
        logps_temperature=0.9,
        micro_batch_size=4,
        pad_multiple=None,
        in_flight=in_flight,
        exact_logps=exact_logps,
        cpus=None,
        threads=torch.get_num_threads(),
    )
    return GenerationServer(model, weights, settings), weights


def test_in_flight_update_changes_the_weights_between_decode_steps(tiny_model_path, tokenizer):
    server, weights = server_and_weights(tiny_model_path, tokenizer, max_tokens=8)
    old = [p.detach().clone() for p in server.params]
    new = [p + 0.05 * torch.randn_like(p) for p in old]
    weights.publish(old, version=0, pinned=set())
    prompt = tokenizer("cat 1 and dog")["input_ids"]
    request = Request(0, [prompt], 2, [11], slot=None)
    steady = server.generate(request)
    assert steady.token_versions == [[0] * len(c.token_ids) for c in steady.completions]

    swap_at, take = 3, server.backend.before_decode_step

    def publish_then_take(step):  # the trainer publishes while step 3 waits
        if step == swap_at:
            weights.publish(new, version=1, pinned=set())
        take(step)

    server.backend.before_decode_step = publish_then_take
    weights.publish(old, version=0, pinned=set())
    swapped = server.generate(request)
    for before, after, versions in zip(steady.completions, swapped.completions, swapped.token_versions):
        assert after.token_ids[:swap_at] == before.token_ids[:swap_at]  # sampled before the swap
        assert versions == [0] * swap_at + [1] * (len(after.token_ids) - swap_at)
        assert after.logprobs[:swap_at] == pytest.approx(before.logprobs[:swap_at], abs=1e-5)
    # Token 3 came from the new weights reading the old weights' cache of the prompt and tokens 0-1.
    completion = swapped.completions[0]
    reference = AutoModelForCausalLM.from_pretrained(tiny_model_path).eval()
    with torch.no_grad():
        for param, value in zip(reference.parameters(), old):
            param.copy_(value)
        cache = DynamicCache(config=reference.config)
        reference(torch.tensor([prompt + completion.token_ids[: swap_at - 1]]), cache=cache)
        for param, value in zip(reference.parameters(), new):
            param.copy_(value)
        logits = reference(torch.tensor([completion.token_ids[swap_at - 1 : swap_at]]), cache=cache).logits
    expected = (logits[0, -1].double() / 0.9).log_softmax(-1)[completion.token_ids[swap_at]]
    assert completion.logprobs[swap_at] == pytest.approx(float(expected), abs=1e-4)


@pytest.mark.parametrize("exact", [True, False], ids=["trainers_forward", "decode_loop"])
def test_log_probs_without_a_swap(tiny_model_path, tokenizer, exact):
    """exact_logps (k = 0): bitwise the trainer's forward; otherwise the decode loop's own, equal up to rounding."""
    server, weights = server_and_weights(tiny_model_path, tokenizer, max_tokens=6, in_flight=False, exact_logps=exact)
    weights.publish([p.detach().clone() for p in server.params], version=4, pinned=set())
    prompts = [tokenizer("sun 2 and moon")["input_ids"], tokenizer("tree")["input_ids"]]
    result = server.generate(Request(0, prompts, 2, [5, 6], slot=weights.slot_of(4)))
    from posttrain.online.logps import completion_logps
    from posttrain.online.rollout import pad_rows

    chunk = result.completions
    prompt_ids, prompt_mask = pad_rows([prompts[c.prompt_index] for c in chunk], tokenizer.pad_token_id, True)
    ids, mask = pad_rows([c.token_ids for c in chunk], tokenizer.pad_token_id, False)
    batch = {"prompt_ids": prompt_ids, "prompt_mask": prompt_mask, "completion_ids": ids, "completion_mask": mask}
    with torch.no_grad():
        logps, _ = completion_logps(server.model, batch, 0.9)
    for row, completion in enumerate(chunk):
        expected = logps[row, : len(completion.token_ids)].tolist()
        assert completion.logprobs == (expected if exact else pytest.approx(expected, abs=1e-5))
    assert result.token_versions == [[4] * len(c.token_ids) for c in chunk]


# -- bounded staleness ---------------------------------------------------------------------------------------
def test_max_staleness_leaves_older_episodes_out_of_the_loss(tmp_path, tiny_model_path):
    """Two rounds ahead: rounds 2 and 3 are two steps stale when they train; max_staleness=1 drops them."""
    trainer = grpo(
        tiny_model_path,
        tmp_path,
        max_steps=4,
        async_generation_rounds=2,
        async_generation_process=False,
        max_staleness=1,
    )
    rollouts = record_rollouts(trainer)
    trainer.train()
    logged = {h["step"]: h for h in trainer.state.log_history if "loss" in h}
    assert [logged[s]["sample/staleness_max"] for s in range(1, 5)] == [0.0, 1.0, 2.0, 2.0]
    assert [logged[s]["sample/dropped_stale"] for s in range(1, 5)] == [0.0, 0.0, 8.0, 8.0]
    assert [int(r.loss_mask.sum() > 0) for r in rollouts] == [1, 1, 0, 0]
    assert all(e["stale"] for r in rollouts[2:] for e in r.episodes)


@pytest.mark.parametrize(
    "overrides, message",
    [
        (dict(max_staleness=2), "max_staleness=2 applies to asynchronous generation, which is off"),
        (dict(async_generation_process=True), "async_generation_process=True applies to asynchronous generation"),
        (dict(async_generation_rounds=1, async_generation_cores=0), "async_generation_cores=0 must be at least 1"),
        (dict(async_generation_rounds=1, max_staleness=-1), "max_staleness=-1 must be >= 0"),
    ],
)
def test_bad_process_settings_stop_before_training(tmp_path, tiny_model_path, overrides, message):
    with pytest.raises(ConfigError, match=message):
        grpo(tiny_model_path, tmp_path, **overrides)


def test_auto_falls_back_to_the_thread_without_two_free_cores(tmp_path, tiny_model_path, monkeypatch):
    monkeypatch.setattr(process_rollouts, "free_cores", lambda *args: {"0": [0]})
    trainer = grpo(tiny_model_path, tmp_path, async_generation_rounds=1, async_generation_process=None)
    assert type(trainer.rollout_producer) is ThreadRolloutProducer
    with pytest.raises(ConfigError, match="async_generation_process=True, but"):
        grpo(tiny_model_path, tmp_path, async_generation_rounds=1, cache_implementation="static", **PROCESS)


def test_the_command_line_trains_with_a_generation_process(tmp_path, tiny_model_path):
    cli = importlib.import_module("posttrain.cli.main")  # the module (posttrain.cli.main is the function)

    rows = [json.dumps({"prompt": f"cat {i} and dog"}) for i in range(8)]
    (tmp_path / "prompts.jsonl").write_text("\n".join(rows) + "\n")
    argv = ["grpo", "--model_name_or_path", tiny_model_path, "--dataset_name", str(tmp_path / "prompts.jsonl")]
    argv += ["--reward_funcs", "think_format_reward", "--num_generations", "2", "--max_completion_length", "4"]
    argv += ["--per_device_train_batch_size", "4", "--max_steps", "2", "--logging_steps", "1", "--report_to", "none"]
    argv += ["--save_strategy", "no", "--output_dir", str(tmp_path / "out"), "--async_generation_rounds", "1"]
    argv += ["--async_generation_process", "true", "--max_staleness", "3"]
    assert cli.main(argv) == 0
    logged = [json.loads(line) for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    steps = [row for row in logged if "loss" in row]
    assert [row["sample/staleness_max"] for row in steps] == [0.0, 1.0]
    assert all(row["async/generation_restarts"] == 0.0 for row in steps)  # the process producer's own metric
