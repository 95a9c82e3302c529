"""SFTTrainer on two CPU processes (DDP over gloo) against one process with the same effective batch,
and both against a float64 reference: the same rows, the same token-normalised loss and metrics,
the same parameters after one SGD step."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from _paths import subprocess_pythonpath
from _sft_ddp_worker import LEARNING_RATE, train_one_step, varied_length_data
from transformers import AutoModelForCausalLM

WORKER = Path(__file__).parents[1] / "_sft_ddp_worker.py"
REPO_ROOT = Path(__file__).resolve().parents[2]


def _launch_two_processes(model_path: str, out_dir: Path) -> list[dict]:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=subprocess_pythonpath())
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node",
        "2",
        str(WORKER),
        model_path,
        str(out_dir),
        "2",
    ]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return [torch.load(out_dir / f"rank{r}.pt") for r in range(2)]


@pytest.fixture(scope="module")
def trained_model_path(tmp_path_factory, tiny_model_path):
    """The tiny model after a few Adam steps on the test data: per-token losses then differ a lot
    (some tokens are learnt, some are not), so averaging per row or per process would show."""
    from posttrain import SFTConfig, SFTTrainer

    out = tmp_path_factory.mktemp("trained")
    args = SFTConfig(
        output_dir=str(out),
        per_device_train_batch_size=8,
        max_steps=12,
        learning_rate=3e-2,
        use_cpu=True,
        bf16=False,
        report_to="none",
        save_strategy="no",
        disable_tqdm=True,
        seed=0,
    )
    trainer = SFTTrainer(tiny_model_path, args=args, train_dataset=varied_length_data())
    trainer.train()
    trainer.save_model(str(out / "model"))
    return str(out / "model")


def _float64_gradient(model_path: str, rows: list[tuple[list[int], list[int]]]) -> tuple[float, float, dict]:
    """Mean NLL over all trained tokens of `rows`, token accuracy, and the gradient of that mean."""
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float64)
    total, correct, count = 0.0, 0, 0
    for input_ids, labels in rows:
        logits = model(input_ids=torch.tensor([input_ids])).logits[0]
        targets = torch.tensor(labels[1:])
        keep = targets != -100
        logps = torch.log_softmax(logits[:-1][keep], -1)
        total = total - logps.gather(1, targets[keep, None]).sum()
        correct += int((logps.argmax(-1) == targets[keep]).sum())
        count += int(keep.sum())
    loss = total / count
    loss.backward()
    return loss.item(), correct / count, {n: p.grad for n, p in model.named_parameters()}


def test_two_processes_match_one_process_with_the_same_effective_batch(tmp_path, trained_model_path):
    model_path = trained_model_path
    ranks = _launch_two_processes(model_path, tmp_path / "ddp")
    single = train_one_step(model_path, str(tmp_path / "single"), per_device_batch_size=4)

    assert [r["rank"] for r in ranks] == [0, 1]
    assert all(r["world_size"] == 2 and r["dist_world_size"] == 2 for r in ranks)
    assert single["world_size"] == 1

    # Each process trained on two rows; together, the four rows of the single process.
    assert all(len(r["rows_seen"]) == 2 for r in ranks)
    assert sorted(ranks[0]["rows_seen"] + ranks[1]["rows_seen"]) == sorted(single["rows_seen"])
    assert len({len(ids) for ids, _ in single["rows_seen"]}) > 1, "rows must differ in length for this test"

    loss, accuracy, grads = _float64_gradient(model_path, single["rows_seen"])
    initial = AutoModelForCausalLM.from_pretrained(model_path).state_dict()
    expected = {n: (initial[n].double() - LEARNING_RATE * g).float() for n, g in grads.items()}
    # Averaging the loss per process instead of over all tokens would move the parameters differently
    # by far more than the tolerance; so would a step that does not move them.
    per_process = [_float64_gradient(model_path, r["rows_seen"]) for r in ranks]
    assert abs(sum(p[0] for p in per_process) / 2 - loss) > 1e-2
    assert (
        max(
            (per_process[0][2][n] + per_process[1][2][n] - 2 * g).abs().max().item() * LEARNING_RATE / 2
            for n, g in grads.items()
        )
        > 1e-3
    )
    assert max((expected[n] - initial[n]).abs().max().item() for n in expected) > 1e-2
    assert 0 < accuracy < 1

    trained = sum(sum(t != -100 for t in labels[1:]) for _, labels in single["rows_seen"])
    for result in [single, *ranks]:
        assert result["loss"] == pytest.approx(loss, abs=1e-6)
        assert result["mean_token_accuracy"] == pytest.approx(accuracy, abs=1e-6)
        assert result["num_tokens_trained"] == trained

    for result in [single, *ranks]:
        for name, value in expected.items():
            torch.testing.assert_close(result["params"][name], value, atol=1e-6, rtol=0)
