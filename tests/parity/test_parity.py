"""posttrain against a snapshot of TRL 1.16's public surface (tests/fixtures/trl_1.16_surface.json, written by
scripts/trl_surface.sh): every top-level name, `data_utils` function, trainer keyword argument (in TRL's order)
and config field (with TRL's default) exists in posttrain, or its difference is explained in
docs/trl_parity.md. Explanations of differences that no longer exist fail too, so the document stays true."""

import dataclasses
import fnmatch
import importlib
import inspect
import json
import re
from pathlib import Path

import pytest

import posttrain

ROOT = Path(__file__).resolve().parents[2]
SURFACE = json.loads((ROOT / "tests/fixtures/trl_1.16_surface.json").read_text())


def documented_differences() -> set[str]:
    """The keys in the first column of docs/trl_parity.md's tables: lines like '| `SFTConfig.bf16` | ...'; a key
    may be a shell-style pattern ('*Config.bf16') covering one difference in several classes."""
    text = (ROOT / "docs/trl_parity.md").read_text()
    return set(re.findall(r"^\| `([^`]+)` \|", text, flags=re.MULTILINE))


def _default(field: dataclasses.Field):
    if field.default is not dataclasses.MISSING:
        value = field.default
    elif field.default_factory is not dataclasses.MISSING:
        value = field.default_factory()
    else:
        return "<required>"
    return value if isinstance(value, (type(None), bool, int, float, str)) else repr(value)


def surface_gaps() -> dict[str, str]:
    """Every way posttrain differs from the snapshot, keyed like docs/trl_parity.md's rows."""
    gaps = {}
    for name in SURFACE["top_level"]:
        if not hasattr(posttrain, name):
            gaps[f"posttrain.{name}"] = "missing top-level name"
    for module in SURFACE["top_level_modules"]:
        try:
            importlib.import_module(f"posttrain.{module}")
        except ImportError:
            gaps[f"posttrain.{module}"] = "missing module"
    data_utils = importlib.import_module("posttrain.data_utils") if "posttrain.data_utils" not in gaps else None
    for name in SURFACE["data_utils"]:
        if data_utils is None or not callable(getattr(data_utils, name, None)):
            gaps[f"data_utils.{name}"] = "missing function"
    for trainer, params in SURFACE["trainers"].items():
        cls = getattr(posttrain, trainer, None)
        ours = [p for p in inspect.signature(cls.__init__).parameters if p != "self"] if cls else []
        for position, param in enumerate(params):
            if param not in ours:
                gaps[f"{trainer}({param})"] = "missing keyword argument"
            elif ours.index(param) != position:
                gaps[f"{trainer}({param})"] = f"at position {ours.index(param)}, TRL's is {position}"
    for config, expected in SURFACE["configs"].items():
        cls = getattr(posttrain, config, None)
        ours = {f.name: _default(f) for f in dataclasses.fields(cls)} if cls else {}
        for name, default in expected.items():
            if name not in ours:
                gaps[f"{config}.{name}"] = "missing field"
            elif ours[name] != default:
                gaps[f"{config}.{name}"] = f"default {ours[name]!r}, TRL's {default!r}"
    return gaps


def test_snapshot_is_trl_1_16():
    assert SURFACE["trl_version"] == "1.16.0"
    assert "SFTTrainer" in SURFACE["top_level"] and len(SURFACE["configs"]["GRPOConfig"]) > 70


def _explained(key: str, patterns: set[str]) -> bool:
    return any(fnmatch.fnmatchcase(key, pattern) for pattern in patterns)


def test_every_difference_from_trl_is_explained():
    patterns = documented_differences()
    unexplained = {k: v for k, v in surface_gaps().items() if not _explained(k, patterns)}
    assert not unexplained, "Differences from TRL 1.16 not explained in docs/trl_parity.md:\n" + "\n".join(
        f"  {k}: {v}" for k, v in sorted(unexplained.items())
    )


def test_no_stale_explanations():
    gaps = set(surface_gaps())
    stale = [p for p in documented_differences() if not any(fnmatch.fnmatchcase(k, p) for k in gaps)]
    assert not stale, f"docs/trl_parity.md explains differences that no longer exist: {sorted(stale)}"


@pytest.mark.parametrize(
    "config",
    sorted(c for c in SURFACE["configs"] if c.endswith("Config") and c not in ("ModelConfig", "DatasetMixtureConfig")),
)
def test_configs_build_with_trl_defaults_on_cpu(config, tmp_path):
    """Every config builds with its defaults alone; bf16 resolves to on as in TRL, on any device, and gradient
    checkpointing to on with an accelerator and off on a CPU (docs/trl_parity.md)."""
    import torch

    args = getattr(posttrain, config)(output_dir=str(tmp_path))
    assert args.bf16 is True and args.gradient_checkpointing is torch.cuda.is_available()
    assert args.logging_steps == SURFACE["configs"][config]["logging_steps"] == 10


# TRL 1.16's module surface: every public name at every TRL module path exists at the same path under posttrain (the
# snapshot's "modules": each module's __all__, or the classes and functions it defines), except these deliberate
# absences, each with its reason. A key is "trl.<module>.<name>" or "trl.<module>.*" (the whole module).
_ASYNC_WORKER = (
    "TRL's asynchronous trainers run a separate rollout-worker process fed through a queue dataset, batchers and an "
    "NCCL/HTTP weight-transfer client; posttrain's asynchronous trainers run on the online engine's own producer "
    "(posttrain/online/producers/thread.py), which has none of these objects (TRL's worker objects are refused by name "
    "in posttrain/online/async_pipeline.py)"
)
_ASYNC_TRAINER_INTERNALS = (
    "DataCollatorForRollout FixedCountBatcher RolloutQueueDataset RolloutWorkerProtocol StepIntervalCallback "
    "TokenBudgetBatcher WeightTransferProtocol log_rollout_traces round_lora_rank save_lora_adapter "
    "select_adapter_sync validate_lora_for_vllm_sync"
).split()
MODULE_ABSENCES = {
    **{
        f"trl.experimental.{m}.{m}_trainer.{n}": _ASYNC_WORKER
        for m in ("async_grpo", "async_distillation")
        for n in _ASYNC_TRAINER_INTERNALS
    },
    "trl.experimental.async_grpo.async_rollout_worker.*": _ASYNC_WORKER,
    "trl.experimental.async_grpo.weight_transfer.*": _ASYNC_WORKER,
    "trl.experimental.async_distillation.async_rollout_worker.*": _ASYNC_WORKER,
    "trl.experimental.async_distillation.weight_transfer.*": _ASYNC_WORKER,
    "trl.experimental.async_grpo.packing.*": (
        "tree attention for TRL's packed multi-turn rollouts (a custom attention function registered with "
        "transformers); posttrain packs with its own segment attention (posttrain/models/segment_attention.py)"
    ),
    "trl.generation.vllm_generation.VLLMGeneration": (
        "TRL's in-trainer vLLM driver class; posttrain's is the generation backend of posttrain/generation/"
        "vllm_backend.py, with posttrain's backend interface (create_generation_backend)"
    ),
    "trl.cli.accelerate_config.*": (
        "TRL's CLI hands multi-process runs to `accelerate launch`; `posttrain` reads the accelerate config and "
        "launches its processes itself (cli/launch.py)"
    ),
    "trl.cli.accelerate_launcher.*": (
        "TRL's CLI hands multi-process runs to `accelerate launch`; `posttrain` reads the accelerate config and "
        "launches its processes itself (cli/launch.py)"
    ),
    "trl.experimental.merge_model_callback.merge_models": (
        "runs mergekit's MergeConfiguration; posttrain merges with its own MergeConfig "
        "(posttrain.callbacks.merge_model.merge_model_weights) and does not depend on mergekit"
    ),
    "trl.experimental.sdft.sdft_trainer.DemonstrationTeacherContextBuilder": (
        "TRL's helper class that builds the teacher's prompt; posttrain's SDFTTrainer builds it in "
        "_teacher_prompts (posttrain/experimental/sdft/sdft_trainer.py)"
    ),
    "trl.experimental.sdpo.sdpo_trainer.SuccessfulRolloutTeacherContextBuilder": (
        "TRL's helper class that builds the teacher's prompt; posttrain's SDPOTrainer builds it in "
        "_teacher_prompts (posttrain/experimental/sdpo/sdpo_trainer.py)"
    ),
    "trl.experimental.sdft.sdft_trainer.DistillationLogits": (
        "TRL's container of student/teacher logits between its methods; posttrain passes them as arguments "
        "(posttrain/trainers/self_distillation.py)"
    ),
    "trl.experimental.sdpo.sdpo_trainer.DistillationLogits": (
        "TRL's container of student/teacher logits between its methods; posttrain passes them as arguments "
        "(posttrain/trainers/self_distillation.py)"
    ),
}


def _posttrain_has(module: str, name: str) -> bool:
    try:
        target = importlib.import_module("posttrain" + module.removeprefix("trl"))
    except ImportError:
        return False
    if hasattr(target, name):
        return True
    try:  # a submodule named in TRL's __all__ (trl.trainer's "dpo_trainer", trl.rewards' "accuracy_rewards")
        importlib.import_module(f"{target.__name__}.{name}")
        return True
    except ImportError:
        return False


def _absence(module: str, name: str) -> str | None:
    return MODULE_ABSENCES.get(f"{module}.{name}") or MODULE_ABSENCES.get(f"{module}.*")


def module_surface_gaps() -> list[str]:
    return [
        f"{module}.{name}"
        for module, names in SURFACE["modules"].items()
        for name in names
        if not _posttrain_has(module, name)
    ]


def test_module_snapshot_counts_trl_1_16():
    assert len(SURFACE["modules"]) == 124 and sum(map(len, SURFACE["modules"].values())) == 400


def test_every_trl_module_name_exists_at_the_same_path():
    missing = [key for key in module_surface_gaps() if not _absence(*key.rsplit(".", 1))]
    assert not missing, "TRL 1.16 names missing at the same path under posttrain:\n  " + "\n  ".join(missing)


def test_every_deliberate_absence_is_still_absent_and_has_a_reason():
    gaps = module_surface_gaps()
    for key, reason in MODULE_ABSENCES.items():
        assert len(reason) > 30, key
        covered = [g for g in gaps if g == key or (key.endswith(".*") and g.rsplit(".", 1)[0] == key[:-2])]
        assert covered, f"{key} exists in posttrain now: drop it from MODULE_ABSENCES"
