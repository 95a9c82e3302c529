"""runtime/gc_freeze.py: the objects of posttrain's imports leave the garbage collector's scans, objects made later
are still collected, and training gives the same results with and without it."""

import gc
import json
import os
import subprocess
import sys
import weakref

import pytest
from _subprocess_result import result_of

from posttrain.runtime.gc_freeze import ENV_VAR

RUN = r"""
import gc, json, sys
import torch
from datasets import Dataset
import posttrain.training.base  # the freeze happens here
frozen, tracked = gc.get_freeze_count(), len(gc.get_objects())
from posttrain import RewardConfig, RewardTrainer
rows = [{"prompt": "the sky is", "chosen": " blue" * (1 + i % 3), "rejected": " red green" * (1 + i % 2)}
        for i in range(16)]
args = RewardConfig(output_dir=sys.argv[2], per_device_train_batch_size=4, max_steps=3, learning_rate=1e-3,
                    logging_steps=1, save_strategy="no", report_to="none", use_cpu=True, seed=0, max_length=32,
                    disable_tqdm=True, bf16=False, write_report=False)
trainer = RewardTrainer(sys.argv[1], args=args, train_dataset=Dataset.from_list(rows))
trainer.train()
losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
weights = [p.detach().double().sum().item() for p in trainer.model.parameters()]
print("RESULT " + json.dumps({"frozen": frozen, "tracked": tracked, "losses": losses, "weights": weights}))
"""


def _run(tiny_model_path, tmp_path, freeze: str) -> dict:
    env = {**os.environ, ENV_VAR: freeze, "OMP_NUM_THREADS": "1"}
    return result_of(RUN, [tiny_model_path, str(tmp_path / freeze)], env)


@pytest.fixture(scope="module")
def runs(tiny_model_path, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("gc_freeze")
    return {freeze: _run(tiny_model_path, tmp, freeze) for freeze in ("1", "0")}


def test_import_time_objects_are_frozen_and_the_switch_turns_it_off(runs):
    on, off = runs["1"], runs["0"]
    # torch, transformers and datasets alone are well over 100k objects; what a full collection still visits
    # after the freeze is a small remainder
    assert on["frozen"] > 100_000 and on["tracked"] < on["frozen"] / 5
    assert off["frozen"] == 0 and off["tracked"] > 100_000


def test_training_results_are_the_same_with_and_without_the_freeze(runs):
    assert len(runs["1"]["losses"]) == 3
    assert runs["1"]["losses"] == runs["0"]["losses"]
    assert runs["1"]["weights"] == runs["0"]["weights"]


def test_objects_made_after_the_import_are_still_collected():
    import posttrain.training.base  # noqa: F401  (frozen by now in this process, unless switched off)

    class Node:
        pass

    a, b = Node(), Node()
    a.other, b.other = b, a  # a reference cycle: only the collector frees it
    alive = weakref.ref(a)
    del a, b
    gc.collect()
    assert alive() is None
