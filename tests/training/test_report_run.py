"""What a run leaves behind, from the Python API: metrics.jsonl (every log entry, as logged), report.html with
its plots, the model card; `python -m posttrain report` on a run that saved nothing else; per-function rewards."""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys

import pytest
from datasets import Dataset

from posttrain import SFTConfig, SFTTrainer
from posttrain.training.report import load_log_history, write_report


def _run(tmp_path, tiny_model_path, **kw):
    rows = [{"prompt": f"{i} plus 1 is", "completion": f" {i + 1}"} for i in range(12)]
    base = dict(
        output_dir=str(tmp_path / "out"),
        per_device_train_batch_size=4,
        max_steps=3,
        logging_steps=2,
        save_strategy="no",
        report_to="none",
        use_cpu=True,
        bf16=False,
        max_length=32,
        disable_tqdm=True,
    )
    base.update(kw)
    trainer = SFTTrainer(tiny_model_path, args=SFTConfig(**base), train_dataset=Dataset.from_list(rows))
    trainer.train()
    return trainer


def _jsonl(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_a_python_api_run_leaves_metrics_report_and_model_card(tmp_path, tiny_model_path):
    trainer = _run(tmp_path, tiny_model_path)
    out = tmp_path / "out"
    history = trainer.state.log_history
    # max_steps=3, logging_steps=2: step 2, then the last partial window (step 3) is logged too, then the summary.
    assert [row["step"] for row in history] == [2, 3, 3] and "loss" in history[1] and "train_loss" in history[2]
    assert _jsonl(out / "metrics.jsonl") == history
    assert (out / "report.html").is_file() and (out / "plot_loss.svg").read_text().startswith("<svg ")
    card = (out / "README.md").read_text()
    assert "trained with **SFT**" in card and f"`{tiny_model_path}`" in card
    assert f"| `loss` | {history[1]['loss']:.6g} |" in card


def test_write_report_false_keeps_metrics_but_writes_no_report(tmp_path, tiny_model_path):
    trainer = _run(tmp_path, tiny_model_path, write_report=False)
    out = tmp_path / "out"
    assert _jsonl(out / "metrics.jsonl") == trainer.state.log_history
    assert not (out / "report.html").exists() and not list(out.glob("plot_*"))


def test_python_m_posttrain_report_works_without_any_saved_state(tmp_path, tiny_model_path):
    """save_strategy='no' leaves no trainer_state.json: `python -m posttrain report` reads metrics.jsonl."""
    trainer = _run(tmp_path, tiny_model_path, write_report=False)
    out = tmp_path / "out"
    assert not list(out.rglob("trainer_state.json"))
    result = subprocess.run(
        [sys.executable, "-m", "posttrain", "report", str(out), "--title", "again"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == str(out / "report.html")
    assert "<title>again</title>" in (out / "report.html").read_text()
    assert load_log_history(out) == trainer.state.log_history
    version = subprocess.run(
        [sys.executable, "-m", "posttrain", "--version"], capture_output=True, text=True, timeout=120
    )
    assert version.returncode == 0 and version.stdout.startswith("posttrain ")


def test_resuming_keeps_exactly_the_restored_history(tmp_path, tiny_model_path):
    """Rows the interrupted run logged after its last checkpoint are not counted twice."""
    import shutil

    options = dict(max_steps=4, logging_steps=1, save_strategy="steps", save_steps=2, write_report=False)
    _run(tmp_path, tiny_model_path, **options)
    out = tmp_path / "out"
    first = _jsonl(out / "metrics.jsonl")
    shutil.rmtree(out / "checkpoint-4")  # as if killed after logging step 4, before its checkpoint was complete
    rows = [{"prompt": f"{i} plus 1 is", "completion": f" {i + 1}"} for i in range(12)]
    args = SFTConfig(
        output_dir=str(out),
        per_device_train_batch_size=4,
        report_to="none",
        use_cpu=True,
        bf16=False,
        max_length=32,
        disable_tqdm=True,
        **options,
    )
    trainer = SFTTrainer(tiny_model_path, args=args, train_dataset=Dataset.from_list(rows))
    trainer.train(resume_from_checkpoint=True)
    resumed = _jsonl(out / "metrics.jsonl")
    assert resumed == trainer.state.log_history
    assert [row["step"] for row in resumed if "loss" in row] == [1, 2, 3, 4]
    assert resumed[:2] == first[:2] and len(resumed) == len(first)


def test_metrics_jsonl_wins_and_a_half_written_last_line_is_skipped(tmp_path):
    (tmp_path / "trainer_state.json").write_text(json.dumps({"log_history": [{"loss": 9.0, "step": 9}]}))
    (tmp_path / "metrics.jsonl").write_text('{"loss": 1.0, "step": 1}\n{"loss": NaN, "step": 2}\n{"loss": 0.5, "st')
    history = load_log_history(tmp_path)
    assert history[0] == {"loss": 1.0, "step": 1} and math.isnan(history[1]["loss"]) and len(history) == 2
    (tmp_path / "metrics.jsonl").write_text('{"loss": 1.0, "st\n{"loss": 0.5, "step": 2}\n')
    with pytest.raises(Exception, match="line 1 is not valid JSON"):
        load_log_history(tmp_path)


def test_completions_table_has_a_column_per_reward_function(tmp_path):
    records = [
        {
            "step": 1,
            "prompt": "p",
            "completion": "a",
            "reward": 1.5,
            "rewards": {"format_reward": 1.0, "/models/org/Skywork-RM": 0.5},
        },
        {
            "step": 1,
            "prompt": "p",
            "completion": "b",
            "reward": 0.25,
            "rewards": {"format_reward": None, "/models/org/Skywork-RM": 0.25},
        },
        {"step": 2, "prompt": "q", "completion": "c", "reward": 2.0},
    ]
    (tmp_path / "completions.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    page = write_report(tmp_path, log_history=[{"loss": 1.0, "step": 1}]).read_text()
    header = re.search(r"<tr><th>step</th>.*?</tr>", page).group(0)
    assert header == (
        "<tr><th>step</th><th>prompt</th><th>completion</th><th>reward</th><th>format_reward</th>"
        "<th>Skywork-RM</th></tr>"
    )
    numbers = [
        re.findall(r'<td class="num">(.*?)</td>', row)
        for row in re.findall(r"<tr><td class=\"num\">.*?</tr>", page, flags=re.S)
    ]
    assert numbers == [["1", "1.5", "1", "0.5"], ["1", "0.25", "", "0.25"], ["2", "2", "", ""]]
