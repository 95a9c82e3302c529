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

    trainer = [{"tokens": [5, 6, 7], "logprobs": [-1.0, -2.0, -0.5]}, {"tokens": [9], "logprobs": [-3.0]}]
    close = [{"tokens": [5, 6, 7], "logprobs": [-1.0004, -2.0, -0.5]}, {"tokens": [9], "logprobs": [-3.0002]}]
    result = gpu_vllm_sync.compare(trainer, close)
    assert result["tokens_equal"] and result["match"] and abs(result["max_logp_diff"] - 4e-4) < 1e-9
    far = [{"tokens": [5, 6, 7], "logprobs": [-1.0, -2.01, -0.5]}, {"tokens": [9], "logprobs": [-3.0]}]
    assert not gpu_vllm_sync.compare(trainer, far)["match"]  # 1e-2 nats apart
    other = [{"tokens": [5, 8, 7], "logprobs": [-1.0, -2.0, -0.5]}, {"tokens": [9], "logprobs": [-3.0]}]
    assert not gpu_vllm_sync.compare(trainer, other)["tokens_equal"]
    assert not gpu_vllm_sync.compare(trainer, other)["match"]


def test_a_missing_package_stops_the_check_naming_the_wheel(capsys):
    required = dict(gpu_check.REQUIRED, nonexistent_pkg=("nonexistent-pkg", "1.0", "nonexistent-pkg==1.0"))
    with pytest.raises(SystemExit) as stopped:
        gpu_check.preflight(dry_run=True, required=required)
    assert stopped.value.code == 2
    assert "missing wheel nonexistent-pkg==1.0: nonexistent_pkg cannot be imported" in capsys.readouterr().err
    old = {"torch": ("torch", "99.0", "torch (newer)")}
    assert gpu_check.missing_wheels(old) == [
        f"torch (newer): torch {__import__('torch').__version__} is older than 99.0"
    ]


def test_without_cuda_the_real_check_refuses_to_start(capsys):
    if __import__("torch").cuda.is_available():
        pytest.skip("a CUDA device is visible")
    with pytest.raises(SystemExit):
        gpu_check.preflight(dry_run=False, required={})
    assert "no CUDA device is visible; use --dry-run" in capsys.readouterr().err


def test_the_real_configs_have_the_real_sizes(smollm2_path):
    import torch
    from transformers import AutoModelForCausalLM

    tokenizer, configs = gpu_check.real_configs()
    with torch.device("meta"):
        sizes = {
            name: sum(p.numel() for p in AutoModelForCausalLM.from_config(c).parameters())
            for name, c in configs.items()
        }
    assert 134e6 < sizes["SmolLM2-135M-Instruct"] < 135e6  # 134,515,008 with the tied embedding
    assert 0.59e9 < sizes["Qwen3-0.6B"] < 0.6e9  # 596,049,920 (Qwen3-0.6B's card: 0.6B, 0.44B without embeddings)
    assert max(tokenizer.get_vocab().values()) < configs["Qwen3-0.6B"].vocab_size


def test_mfu_and_peaks():
    assert gpu_check.peak_tflops("NVIDIA H100 80GB HBM3") == 989.4 and gpu_check.peak_tflops("NVIDIA H200") == 989.4
    assert gpu_check.peak_tflops("NVIDIA H100 PCIe") == 756.0 and gpu_check.peak_tflops("Some GPU") is None
    assert gpu_check.flops_per_token("sft_full", 10) == 60 and gpu_check.flops_per_token("sft_lora", 10) == 40
