"""benchmarks/gpu_check.py, the prepared GPU check, kept from rotting before a GPU is at hand: its --dry-run (the
tiny model on the CPU, one step of each run with posttrain and with TRL) writes the JSON and the table; a missing
package stops it first, naming the wheel; the real models' configs have the real parameter counts."""

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
import gpu_check  # noqa: E402


@pytest.mark.skipif(importlib.util.find_spec("trl") is None, reason="TRL is the reference run")
def test_dry_run_writes_the_json_and_the_table(tmp_path):
    command = [sys.executable, str(ROOT / "benchmarks" / "gpu_check.py"), "--dry-run", "--out", str(tmp_path)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    rows = report["rows"]
    assert [(r["run"], r["impl"]) for r in rows] == [(run, i) for run in gpu_check.RUNS for i in ("posttrain", "trl")]
    assert all("error" not in r and r["step_s"] > 0 and r["tokens_per_s"] > 0 for r in rows)
    assert report["device"] == "cpu (dry run)" and report["versions"]["trl"].startswith("1.16")
    table = (tmp_path / "gpu_check.md").read_text()
    assert "| tiny-llama | grpo | trl |" in table and "| tiny-llama | sft_lora | posttrain |" in table
    assert report["vllm_sync"]["skipped"].startswith("skipped: needs 2 CUDA GPUs")  # the vLLM step says why not
    assert "vLLM NCCL weight sync: skipped: needs 2 CUDA GPUs" in table


def test_the_vllm_step_alone_skips_with_a_line_without_a_gpu(tmp_path):
    script = str(ROOT / "benchmarks" / "gpu_check.py")
    command = [sys.executable, script, "--dry-run", "--runs", "", "--out", str(tmp_path)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "gpu_check vllm_sync: skipped: needs 2 CUDA GPUs" in done.stdout
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    assert report["rows"] == [] and "skipped" in report["vllm_sync"]
    without = [*command, "--no-vllm-sync"]
    assert subprocess.run(without, capture_output=True, text=True, timeout=600, cwd=ROOT).returncode == 0
    assert "vllm_sync" not in json.loads((tmp_path / "gpu_check.json").read_text())


def test_the_vllm_step_compares_tokens_and_log_probs():
    import gpu_vllm_sync

    trainer = [{"greedy": [5, 6, 7], "logprobs": [-1.0, -2.0, -0.5]}, {"greedy": [9], "logprobs": [-3.0]}]
    close = [{"greedy": [5, 6, 7], "logprobs": [-1.0004, -2.0, -0.5]}, {"greedy": [9], "logprobs": [-3.0002]}]
    result = gpu_vllm_sync.compare(trainer, close)
    assert result["tokens_equal"] and result["match"] and abs(result["max_logp_diff"] - 4e-4) < 1e-9
    far = [{"greedy": [5, 6, 7], "logprobs": [-1.0, -2.01, -0.5]}, {"greedy": [9], "logprobs": [-3.0]}]
    assert not gpu_vllm_sync.compare(trainer, far)["match"]  # 1e-2 nats apart
    other = [{"greedy": [5, 8, 7], "logprobs": [-1.0, -2.0, -0.5]}, {"greedy": [9], "logprobs": [-3.0]}]
    assert not gpu_vllm_sync.compare(trainer, other)["tokens_equal"]
    assert not gpu_vllm_sync.compare(trainer, other)["match"]
