"""Checkpoints at scale, under the shipped FSDP2 and ZeRO-3 configs (2 CPU processes): the checkpoint holds the
engine's sharded state; a run resumed from it logs the same losses and ends with the same parameters as the run
that did not stop; `trainer.save_model` exports a plain Hugging Face checkpoint that `from_pretrained` loads in
one process with the trained weights. Run with `pytest -m dist tests/dist`.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

from test_equivalence import ROOT, _env

pytestmark = [pytest.mark.dist]

WORKER = Path(__file__).with_name("checkpoint_worker.py")
# dpo_sync: the TR-DPO reference (sharded, and changed by every step) is part of the state a resume restores
TRAINERS = ["sft", "grpo", "dpo_sync"]
# What the engine writes for its sharded state: FSDP2's distributed-checkpoint folder, DeepSpeed's per-rank
# partitions of the parameters and of the optimizer state.
SHARDED_STATE = {"fsdp2": ["pytorch_model_fsdp_0/", "optimizer_0/"],
                 "zero3": ["zero_pp_rank_0_mp_rank_00_model_states.pt", "zero_pp_rank_1_mp_rank_00_model_states.pt",
                           "zero_pp_rank_1_mp_rank_00_optim_states.pt"]}
_launched: dict[str, Path] = {}


def _launch(engine: str, model: str, out: Path) -> Path:
    import subprocess

    if engine not in _launched:
        config = ROOT / "examples" / "accelerate_configs" / f"{engine}.yaml"
        command = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(config),
                   "--main_process_port", "0", str(WORKER), str(out), ",".join(TRAINERS), model]
        done = subprocess.run(command, env=_env(), capture_output=True, text=True, timeout=900)
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
        _launched[engine] = out
    return _launched[engine]


@pytest.mark.parametrize("trainer", TRAINERS)
@pytest.mark.parametrize("engine", ["fsdp2", "zero3"])
def test_sharded_checkpoint_resumes_exactly(engine, trainer, tiny_model_path, tmp_path_factory):
    if engine == "zero3" and importlib.util.find_spec("deepspeed") is None:
        pytest.skip("DeepSpeed is not installed (DS_BUILD_OPS=0 pip install --no-build-isolation deepspeed)")
    out = _launch(engine, tiny_model_path, tmp_path_factory.mktemp(f"checkpoints_{engine}"))
    ranks = [torch.load(out / f"{trainer}.rank{r}.pt", weights_only=False) for r in (0, 1)]
    for rank in ranks:
        assert "error" not in rank, rank["error"]
        assert len(rank["loss"]) == 4 and rank["resumed_step"] == 4
        assert rank["resumed_steps_run"] == 2  # it started from the checkpoint, not from scratch
        # the resumed run continues the stopped one exactly: its history holds steps 1-2 from the checkpoint and
        # the steps 3-4 it computed, and it ends with the same weights
        assert rank["resumed_loss"] == pytest.approx(rank["loss"], abs=1e-6)
        assert rank["params"].keys() == rank["resumed_params"].keys()
        for name, value in rank["params"].items():
            torch.testing.assert_close(rank["resumed_params"][name], value, atol=1e-6, rtol=0, msg=name)
    # both ranks hold the same full model, and the checkpoint holds the engine's shards, not one full copy
    for name, value in ranks[0]["params"].items():
        torch.testing.assert_close(ranks[1]["params"][name], value, atol=0, rtol=0, msg=name)
    files = ranks[0]["checkpoint_files"]
    for expected in SHARDED_STATE[engine]:
        assert any(f.startswith(expected) or f.endswith(expected) for f in files), (expected, files)


@pytest.mark.parametrize("trainer", TRAINERS)
@pytest.mark.parametrize("engine", ["fsdp2", "zero3"])
def test_save_model_exports_a_plain_checkpoint(engine, trainer, tiny_model_path, tmp_path_factory, request):
    """The export loads with from_pretrained in one plain process and holds the trained weights."""
    if engine == "zero3" and importlib.util.find_spec("deepspeed") is None:
        pytest.skip("DeepSpeed is not installed (DS_BUILD_OPS=0 pip install --no-build-isolation deepspeed)")
    out = _launch(engine, tiny_model_path, tmp_path_factory.mktemp(f"checkpoints_{engine}"))
    _check_export(out / "export" / trainer, out / f"{trainer}.rank0.pt", tiny_model_path)


@pytest.mark.parametrize("trainer", TRAINERS)
def test_fsdp2_full_state_dict_export(trainer, tiny_model_path, tmp_path_factory):
    out = _launch("fsdp2", tiny_model_path, tmp_path_factory.mktemp("checkpoints_fsdp2"))
    _check_export(out / "export_fsdp" / trainer, out / f"{trainer}.rank0.pt", tiny_model_path)


def _check_export(export: Path, result: Path, initial: str) -> None:
    from transformers import AutoModelForCausalLM

    trained = torch.load(result, weights_only=False)
    assert "error" not in trained, trained["error"]
    loaded = dict(AutoModelForCausalLM.from_pretrained(export, dtype=torch.float32).named_parameters())
    start = dict(AutoModelForCausalLM.from_pretrained(initial, dtype=torch.float32).named_parameters())
    assert loaded.keys() >= trained["params"].keys()
    for name, value in trained["params"].items():
        torch.testing.assert_close(loaded[name].detach(), value, atol=1e-6, rtol=0, msg=name)
    # the trained weights, not the initial ones
    assert max((loaded[n] - start[n]).abs().max().item() for n in trained["params"]) > 1e-3
