"""No host sync in a training step outside logging steps: `Tensor.item`, `.tolist` and `.cpu` are counted (with
where they were called from) during the second optimizer step of SFT, DPO and GRPO runs that log every 100 steps.
On a GPU each would make the CPU wait for the queued kernels. The metrics are kept on the device and become floats
once per logging window (training/metric_values.py). What remains is listed in SYNCS_BY_DESIGN, each with why: a
new sync in the step fails this test. The GPU check (benchmarks/gpu_check.py) turns on CUDA's sync debug mode."""

import collections
import traceback
from pathlib import Path

import pytest
import torch
from datasets import Dataset
from transformers import TrainerCallback

ROOT = str(Path(__file__).resolve().parents[2]) + "/"
# (method, caller's file) -> why the step needs the value on the host
SYNCS_BY_DESIGN = {
    ("tolist", "posttrain/models/layouts.py"): "a padded batch repacked padding-free: the new shape comes from lengths",
    ("tolist", "posttrain/online/logps.py"): "the same repacking of the scored rollouts' rows",
    ("tolist", "posttrain/generation/transformers_backend.py"): "generated ids decoded to text for the rewards",
    ("tolist", "posttrain/training/reference_trainer.py"): "the reference log-prob memo is keyed by the row ids",
    ("tolist", "posttrain/training/reference_memo.py"): "the reference memo keys rows by digest (a CPU tensor)",
    ("cpu", "posttrain/training/reference_memo.py"): "the memo keeps new rows' reference values in host memory",
    ("tolist", "posttrain/training/preference.py"): "preference token totals (TRL skips a part with no token)",
    ("item", "posttrain/training/preference.py"): "preference num_tokens counter (an int in checkpoints)",
    ("__bool__", "posttrain/training/guards.py"): "the non-finite guard: one check a step decides whether the "
    "optimizer step is applied (loss and gradient norm together)",
}
# GRPO's rollout is generated, scored (rewards are Python values) and assembled on the host before its batches go to
# the device: conversions of its tensors there are host work, which a CPU cannot tell from syncs. The GPU check's
# sync debug mode counts the real ones.
ROLLOUT_ON_THE_HOST = {
    "posttrain/online/evaluation.py",
    "posttrain/online/phases.py",
    "posttrain/online/rollout.py",
    "posttrain/rewards/scoring.py",
    "posttrain/trainers/grpo.py",
}
COMMON = dict(
    use_cpu=True, report_to="none", max_steps=3, logging_steps=100, save_strategy="no", disable_tqdm=True,
    per_device_train_batch_size=4, seed=0,
)  # fmt: skip


class _CountSyncs(TrainerCallback):
    """Counts item/tolist/cpu calls and float/int/bool conversions of tensors made in posttrain's code, by (method,
    calling file), during optimizer step 2 (step 1 sets things up)."""

    def __init__(self, monkeypatch):
        self.calls, self.on = collections.Counter(), False
        for name in ("item", "tolist", "cpu", "__float__", "__int__", "__bool__"):
            monkeypatch.setattr(torch.Tensor, name, self._counted(name, getattr(torch.Tensor, name)))

    def _counted(self, name, real):
        def method(tensor, *args, **kwargs):
            if self.on:
                caller = traceback.extract_stack(limit=2)[0].filename
                if caller.startswith(ROOT + "posttrain/"):  # (transformers' own loop is not ours to change)
                    self.calls[(name, caller.replace(ROOT, ""))] += 1
            return real(tensor, *args, **kwargs)

        return method

    def on_step_begin(self, args, state, control, **kwargs):
        self.on = state.global_step == 1

    def on_step_end(self, args, state, control, **kwargs):
        self.on = False


def _sft(path, tmp_path, callbacks):
    from posttrain.trainers.sft import SFTConfig, SFTTrainer

    data = Dataset.from_list([{"text": f"the cat {'sat ' * (i % 4)}on the mat"} for i in range(16)])
    args = SFTConfig(output_dir=str(tmp_path), max_length=32, **COMMON)
    return SFTTrainer(path, args=args, train_dataset=data, callbacks=callbacks)


def _dpo(path, tmp_path, callbacks):
    from posttrain.trainers.dpo import DPOConfig, DPOTrainer

    words = ["cat", "dog", "sky", "sun"] * 4
    data = Dataset.from_list([{"prompt": f"the {w} is", "chosen": " good", "rejected": " bad bad"} for w in words])
    args = DPOConfig(output_dir=str(tmp_path), max_length=32, ref_cache_dir=str(tmp_path / "ref"), **COMMON)
    return DPOTrainer(path, args=args, train_dataset=data, callbacks=callbacks)


def _grpo(path, tmp_path, callbacks):
    from posttrain.trainers.grpo import GRPOConfig, GRPOTrainer

    data = Dataset.from_list([{"prompt": f"the {w} is"} for w in ["cat", "dog", "sky", "sun"] * 4])
    args = GRPOConfig(output_dir=str(tmp_path), num_generations=2, max_completion_length=8, **COMMON)
    reward = lambda completions, **kw: [float(len(c)) for c in completions]  # noqa: E731
    return GRPOTrainer(path, reward_funcs=reward, args=args, train_dataset=data, callbacks=callbacks)


@pytest.mark.parametrize("build", [_sft, _dpo, _grpo], ids=["sft", "dpo", "grpo"])
def test_a_non_logging_step_syncs_only_where_it_must(build, tiny_model_path, tmp_path, monkeypatch):
    counter = _CountSyncs(monkeypatch)
    trainer = build(tiny_model_path, tmp_path, [counter])
    trainer.train()
    host = ROLLOUT_ON_THE_HOST if build is _grpo else set()
    unexpected = {s: n for s, n in counter.calls.items() if s not in SYNCS_BY_DESIGN and s[1] not in host}
    assert unexpected == {}
    logged = [e for e in trainer.state.log_history if "train_loss" in e]
    assert logged and all(isinstance(v, float) for v in logged[-1].values() if not isinstance(v, int))


def test_record_metrics_keeps_training_values_on_the_device_until_logged(tiny_model_path, tmp_path, monkeypatch):
    trainer = _sft(tiny_model_path, tmp_path, [])
    trainer.model.train()
    item = torch.Tensor.item
    monkeypatch.setattr(torch.Tensor, "item", lambda t: pytest.fail("a sync in record_metrics"))
    trainer.record_metrics({"a": torch.tensor(1.0), "b": 2.0})
    trainer.record_metrics({"a": torch.tensor(3.0), "b": 4.0})
    assert all(isinstance(v, torch.Tensor) for v in trainer._metrics["train"]["a"])
    monkeypatch.setattr(torch.Tensor, "item", item)
    logs = {"loss": 0.5}
    trainer.log(logs)
    assert (logs["a"], logs["b"]) == (2.0, 3.0) and isinstance(logs["a"], float)
