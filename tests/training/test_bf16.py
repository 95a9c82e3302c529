"""bf16 end to end on a CPU: SFT, DPO and GRPO with bf16 autocast over float32 weights, and with bf16 weights, against
the same first step in float32. Tolerances (relative): the first step's loss within 0.1% and its gradient norm within
1% (bf16 keeps 8 bits of mantissa, 0.4% a rounding; measured here: loss 1e-5 and 3e-5, gradient norm 2e-4 and 0.35%
for autocast and bf16 weights), and GRPO's policy entropy within 0.1% (its sampled completions can differ with the
logits' rounding; its entropy over a near-uniform random model cannot by much). Every run must also produce finite
numbers, keep its weights' dtype, and differ from float32 somewhere (bf16 did run)."""

import math

import pytest
import torch
from datasets import Dataset

COMMON = dict(
    use_cpu=True, report_to="none", max_steps=1, logging_steps=1, save_strategy="no", disable_tqdm=True,
    per_device_train_batch_size=4, seed=0, learning_rate=1e-3,
)  # fmt: skip
PRECISIONS = {
    "float32": dict(bf16=False),
    "autocast": dict(bf16=True),
    "bf16_weights": dict(bf16=False, model_init_kwargs={"dtype": "bfloat16"}),
}
PRECISIONS_TESTED = ("autocast", "bf16_weights")


def _sft(path, tmp_path, precision):
    from posttrain.trainers.sft import SFTConfig, SFTTrainer

    data = Dataset.from_list([{"text": f"the cat {'sat ' * (i % 4)}on the mat {i}"} for i in range(8)])
    args = SFTConfig(output_dir=str(tmp_path), max_length=32, **COMMON, **PRECISIONS[precision])
    return SFTTrainer(path, args=args, train_dataset=data)


def _dpo(path, tmp_path, precision):
    from posttrain.trainers.dpo import DPOConfig, DPOTrainer

    words = ["cat", "dog", "sky", "sun"]
    data = Dataset.from_list([{"prompt": f"the {w} is", "chosen": " good", "rejected": " bad bad"} for w in words])
    cache = str(tmp_path / "ref")
    args = DPOConfig(output_dir=str(tmp_path), max_length=32, ref_cache_dir=cache, **COMMON, **PRECISIONS[precision])
    return DPOTrainer(path, args=args, train_dataset=data)


def _grpo(path, tmp_path, precision):
    from posttrain.trainers.grpo import GRPOConfig, GRPOTrainer

    data = Dataset.from_list([{"prompt": f"the {w} is"} for w in ["cat", "dog", "sky", "sun"]])
    args = GRPOConfig(
        output_dir=str(tmp_path), num_generations=4, max_completion_length=8, **COMMON, **PRECISIONS[precision]
    )
    reward = lambda completions, **kw: [float(i % 2) for i in range(len(completions))]  # noqa: E731
    return GRPOTrainer(path, reward_funcs=reward, args=args, train_dataset=data)


def _first_step(build, path, tmp_path, precision):
    trainer = build(path, tmp_path / precision, precision)
    weights = {p.dtype for p in trainer.model.parameters()}
    assert weights == {torch.bfloat16 if precision == "bf16_weights" else torch.float32}
    trainer.train()
    logged = next(e for e in trainer.state.log_history if "loss" in e)
    assert all(math.isfinite(v) for v in logged.values() if isinstance(v, float))
    assert {p.dtype for p in trainer.model.parameters()} == weights  # the update kept them
    return logged


@pytest.mark.parametrize("build", [_sft, _dpo], ids=["sft", "dpo"])
def test_bf16_first_step_matches_float32(build, tiny_model_path, tmp_path):
    reference = _first_step(build, tiny_model_path, tmp_path, "float32")
    for precision in PRECISIONS_TESTED:
        logged = _first_step(build, tiny_model_path, tmp_path, precision)
        assert logged["loss"] == pytest.approx(reference["loss"], rel=1e-3), precision
        assert logged["grad_norm"] == pytest.approx(reference["grad_norm"], rel=1e-2), precision
        assert (logged["loss"], logged["grad_norm"]) != (reference["loss"], reference["grad_norm"])  # bf16 did run


def test_bf16_grpo_step_matches_float32_entropy(tiny_model_path, tmp_path):
    reference = _first_step(_grpo, tiny_model_path, tmp_path, "float32")
    for precision in PRECISIONS_TESTED:
        logged = _first_step(_grpo, tiny_model_path, tmp_path, precision)
        assert logged["entropy"] == pytest.approx(reference["entropy"], rel=1e-3), precision
        assert logged["grad_norm"] > 0
