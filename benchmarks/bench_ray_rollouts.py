"""Rollout actors on Ray (posttrain/online/producers/ray.py), measured on this machine, all on loopback:

- weight sync against model size: one push of the flat per-dtype buffers over a gloo pair (weights/collective.py) to
  an actor, against today's file sync to a vLLM server (the trainer writes `model.safetensors`, the server reads it;
  vllm_weights.save_weights, then safetensors' load_file, both timed; the server's copy into its model is not);
  sizes: the tiny test model, SmolLM2-135M (float32) and a 0.5B model built from a Qwen2.5-0.5B-like config with
  random weights (bfloat16, to stay inside the free memory of a shared machine);
- rollout throughput (completion tokens per second) with 1 and 2 actors, SmolLM2-135M, one thread per actor,
  rounds round-robin with every actor kept busy (k >= 1: a round per actor);
- the same at k = 0: one round at a time (8 prompts), whole on one actor, or split across 2 (producers/ray.py
  `split_round`, as the trainer splits it), and each round waited for before the next;
- an actor restart: from `ray.kill` until the restarted actor holds the newest weights again.

    python benchmarks/bench_ray_rollouts.py --out docs/results/ray_rollouts.json

Writes JSON with the commit (`git rev-parse HEAD`), the date, the machine's load and every figure. On a GPU machine
the same command measures the gloo path only; the NCCL figures are listed in docs/results/ray_rollouts.md.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

for _name, _value in {"RAY_USAGE_STATS_ENABLED": "0", "RAY_ENABLE_UV_RUN_RUNTIME_ENV": "0"}.items():
    os.environ.setdefault(_name, _value)

import ray  # noqa: E402
import torch  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer, Qwen2Config  # noqa: E402

from posttrain.generation import SamplingParams, stop_token_ids  # noqa: E402
from posttrain.generation.vllm_weights import save_weights  # noqa: E402
from posttrain.online.producers.generation_worker import Request, WorkerSettings  # noqa: E402
from posttrain.online.producers.ray import split_round  # noqa: E402
from posttrain.online.producers.ray_actor import rollout_actor_class  # noqa: E402
from posttrain.online.producers.ray_cluster import LOOPBACK  # noqa: E402
from posttrain.online.weights.collective import PairReceiver, PairSender, open_store  # noqa: E402
from posttrain.online.weights.transport import flat_buffers, flat_layout, pack  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
TIMEOUT_S = 600.0
SPLIT_PROMPTS = 8  # a k = 0 round: 16 completions, 2 micro-batches of 8, so 2 parts


@ray.remote(num_cpus=0, resources={"rollout": 1})
class Receiver:
    """The receiving end alone (no model): flat buffers of `layout`, filled by each push."""

    def __init__(self, layout):
        self.buffers = flat_buffers(layout)

    def connect(self, port: int) -> None:
        self.receiver = PairReceiver(LOOPBACK, port, "receiver", TIMEOUT_S)

    def receive(self) -> int:
        return self.receiver.receive(self.buffers)


def qwen_05b_layout() -> list:
    config = Qwen2Config(
        hidden_size=896,
        intermediate_size=4864,
        num_hidden_layers=24,
        num_attention_heads=14,
        num_key_value_heads=2,
        vocab_size=151936,
        tie_word_embeddings=True,
    )
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    return [(dtype, shape, numel) for dtype, shape, numel in flat_layout(model)]


def named_views(layout, buffers) -> list[tuple[str, torch.Tensor]]:
    offsets, views = dict.fromkeys(buffers, 0), []
    for index, (dtype, shape, numel) in enumerate(layout):
        views.append((f"p{index}", buffers[dtype][offsets[dtype] : offsets[dtype] + numel].view(shape)))
        offsets[dtype] += numel
    return views


def sync_times(name: str, layout, repeats: int) -> dict:
    """File sync (write + read) and one gloo push, each the median of `repeats`."""
    from safetensors.torch import load_file

    buffers = {dtype: torch.randn(b.numel()).to(dtype) for dtype, b in flat_buffers(layout).items()}
    size = sum(b.numel() * b.element_size() for b in buffers.values())
    writes, reads, pushes = [], [], []
    with tempfile.TemporaryDirectory() as directory:
        for _ in range(repeats):
            start = time.perf_counter()
            path = save_weights(named_views(layout, buffers), directory)
            writes.append(time.perf_counter() - start)
            start = time.perf_counter()
            loaded = load_file(str(path))
            reads.append(time.perf_counter() - start)
            del loaded
    receiver = Receiver.remote(layout)
    store = open_store(LOOPBACK, TIMEOUT_S)
    ref = receiver.connect.remote(store.port)
    sender = PairSender(store, LOOPBACK, "receiver", TIMEOUT_S)
    ray.get(ref)
    for version in range(repeats):
        start = time.perf_counter()
        ref = receiver.receive.remote()
        sender.send(buffers, version)
        assert ray.get(ref) == version
        pushes.append(time.perf_counter() - start)
    ray.kill(receiver)
    med = statistics.median
    return {
        "model": name,
        "bytes": size,
        "file_write_s": med(writes),
        "file_read_s": med(reads),
        "file_sync_s": med(writes) + med(reads),
        "gloo_push_s": med(pushes),
        "gloo_GBps": size / med(pushes) / 1e9,
        "repeats": repeats,
    }


def settings_for(tokenizer, model, max_tokens: int) -> WorkerSettings:
    return WorkerSettings(
        pad_token_id=tokenizer.pad_token_id,
        stop_ids=tuple(stop_token_ids(tokenizer, model)),
        sampling=SamplingParams(max_tokens=max_tokens, temperature=1.0),
        logps_temperature=1.0,
        micro_batch_size=8,
        pad_multiple=None,
        in_flight=False,
        exact_logps=False,
        cpus=None,
        threads=1,
    )


def start_actor(model_ref, settings, index: int):
    actor = rollout_actor_class(
        resources={"rollout": 1}, num_cpus=0, max_restarts=-1, runtime_env={"env_vars": {"OMP_NUM_THREADS": "1"}}
    ).remote(model_ref, settings, 3, f"rollout actor {index}")
    return actor


def wait_alive(actor) -> dict:
    deadline = time.monotonic() + TIMEOUT_S
    while True:
        try:
            return ray.get(actor.where.remote(), timeout=TIMEOUT_S)
        except ray.exceptions.RayActorError:  # restarting
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


def connect_and_push(actor, buffers, version: int, name: str):
    wait_alive(actor)
    store = open_store(LOOPBACK, TIMEOUT_S)
    ref = actor.connect.remote(LOOPBACK, store.port, TIMEOUT_S)
    sender = PairSender(store, LOOPBACK, name, TIMEOUT_S)
    ray.get(ref, timeout=TIMEOUT_S)
    ref = actor.receive.remote([])
    sender.send(buffers, version)
    ray.get(ref, timeout=TIMEOUT_S)
    return sender, store


def split_rounds(actors, settings, rounds: int, prompt_ids, n: int) -> dict:
    """k = 0: each round split across `actors` (split_round, whole micro-batches per part), waited for before the
    next one is sent."""
    tokens, start = 0, time.perf_counter()
    parts = split_round(len(prompt_ids), len(actors), n, settings.micro_batch_size)
    for r in range(rounds):
        seeds = [1000 * r + i for i in range(len(prompt_ids))]
        refs = [
            actor.generate.remote(
                Request(r, [prompt_ids[i] for i in part], n, [seeds[i] for i in part], None), 0, TIMEOUT_S
            )
            for actor, part in zip(actors, parts)
        ]
        tokens += sum(len(c.token_ids) for answer in ray.get(refs) for c in answer.completions)
    seconds = time.perf_counter() - start
    return {"parts": len(parts), "tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds}


def throughput_and_restart(model_path: str, rounds: int, prompts: int, n: int, max_tokens: int) -> dict:
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    buffers = pack([p for _, p in model.named_parameters()], flat_buffers(flat_layout(model)))
    settings = settings_for(tokenizer, model, max_tokens)
    model_ref = ray.put(model)
    words = ["cat", "dog", "sun", "moon", "tree", "fish", "bird", "sky"]
    prompt_ids = [tokenizer(f"Tell me about the {words[i % 8]} {i}.")["input_ids"] for i in range(prompts)]
    split_prompt_ids = [tokenizer(f"Write about the {words[i % 8]} {i}.")["input_ids"] for i in range(SPLIT_PROMPTS)]
    result = {"model": model_path, "rounds": rounds, "prompts": prompts, "n": n, "max_tokens": max_tokens}
    actors, links = [], []
    for count in (1, 2):
        while len(actors) < count:
            actors.append(start_actor(model_ref, settings, len(actors)))
            links.append(connect_and_push(actors[-1], buffers, 0, f"rollout actor {len(actors) - 1}"))
        ray.get([actor.generate.remote(Request(-1, prompt_ids[:1], 1, [0], None), 0, TIMEOUT_S) for actor in actors])
        start = time.perf_counter()
        refs = [
            actors[r % count].generate.remote(
                Request(r, prompt_ids, n, [1000 * r + i for i in range(prompts)], None), 0, TIMEOUT_S
            )
            for r in range(rounds)
        ]
        tokens = sum(len(c.token_ids) for answer in ray.get(refs) for c in answer.completions)
        seconds = time.perf_counter() - start
        result[f"actors_{count}"] = {"tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds}
        print(json.dumps(result[f"actors_{count}"]), flush=True)
        result[f"split_actors_{count}"] = split_rounds(actors[:count], settings, rounds, split_prompt_ids, n)
        print(json.dumps(result[f"split_actors_{count}"]), flush=True)
    start = time.perf_counter()
    ray.kill(actors[0], no_restart=False)
    time.sleep(0.1)
    links[0] = connect_and_push(actors[0], buffers, 1, "rollout actor 0")
    result["restart_s"] = time.perf_counter() - start
    assert ray.get(actors[0].where.remote())["restarted"]
    for actor in actors:
        ray.kill(actor, no_restart=True)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--skip_05b", action="store_true", help="leave out the 0.5B sync (about 1 GB in bf16)")
    parser.add_argument("--skip_sync", action="store_true", help="only the throughput and the restart")
    parser.add_argument("--out", type=Path)
    options = parser.parse_args()
    from posttrain.models.builtin import builtin_model_path
    from posttrain.models.tiny import build_tiny_model

    smollm2 = builtin_model_path()
    ray.init(
        _node_ip_address=LOOPBACK,
        include_dashboard=False,
        num_cpus=2,
        resources={"rollout": 2},
        object_store_memory=1 << 30,
    )
    tokenizer = AutoTokenizer.from_pretrained(smollm2)
    sizes = [
        ("tiny", flat_layout(build_tiny_model(tokenizer, seed=0))),
        ("SmolLM2-135M fp32", flat_layout(AutoModelForCausalLM.from_pretrained(smollm2))),
    ]
    if not options.skip_05b:
        sizes.append(("Qwen2.5-0.5B-like bf16", qwen_05b_layout()))
    report = {
        "commit": subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "load_before": os.getloadavg(),
        "cpus": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "sync": [],
    }
    for name, layout in [] if options.skip_sync else sizes:
        report["sync"].append(sync_times(name, layout, options.repeats))
        print(json.dumps(report["sync"][-1]), flush=True)
    report["rollouts"] = throughput_and_restart(smollm2, options.rounds, prompts=4, n=2, max_tokens=32)
    print(json.dumps(report["rollouts"]), flush=True)
    report["load_after"] = os.getloadavg()
    ray.shutdown()
    if options.out:
        options.out.write_text(json.dumps(report, indent=1) + "\n")
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
