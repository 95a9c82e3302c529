"""report_to=<tracker> for real, offline: a tiny SFT run logs to each tracker's local store, and the metrics read
back from that store equal the trainer's log_history. Plus the refusal of a named tracker that is not installed."""

from __future__ import annotations

import importlib.util
import json
import sys
import time

import numpy as np
import pytest
from datasets import Dataset

from posttrain import SFTConfig, SFTTrainer
from posttrain.errors import ConfigError

STEPS = 3
# transformers' tracker callbacks send the per-step metrics under train/ (eval under eval/); the run summary
# (train_runtime, train_loss, ...) goes only to some trackers, so the comparison is over the per-step rows.
PER_STEP = ("loss", "grad_norm", "learning_rate", "mean_token_accuracy", "entropy", "num_tokens")


def _train(tmp_path, tiny_model_path, report_to, **extra):
    rows = [{"prompt": f"{i} plus 1 is", "completion": f" {i + 1}"} for i in range(12)]
    args = SFTConfig(
        output_dir=str(tmp_path / "out"),
        per_device_train_batch_size=4,
        max_steps=STEPS,
        logging_steps=1,
        save_strategy="no",
        report_to=report_to,
        use_cpu=True,
        bf16=False,
        max_length=32,
        disable_tqdm=True,
        learning_rate=1e-3,
        write_report=False,
        **extra,
    )
    trainer = SFTTrainer(tiny_model_path, args=args, train_dataset=Dataset.from_list(rows))
    trainer.train()
    logged = {key: [(row["step"], row[key]) for row in trainer.state.log_history if key in row] for key in PER_STEP}
    assert all(len(points) == STEPS for points in logged.values())
    return logged


def _requires(module):
    return pytest.mark.skipif(
        importlib.util.find_spec(module) is None, reason=f"{module} is not installed (pip install -e '.[dev]')"
    )


@_requires("tensorboard")
def test_tensorboard_event_files_hold_the_logged_metrics(tmp_path, tiny_model_path, monkeypatch):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    monkeypatch.setenv("TENSORBOARD_LOGGING_DIR", str(tmp_path / "tb"))
    logged = _train(tmp_path, tiny_model_path, "tensorboard")
    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    for key, points in logged.items():
        read = [(event.step, event.value) for event in events.Scalars(f"train/{key}")]
        # TensorBoard stores scalars as float32.
        assert read == [(step, float(np.float32(value))) for step, value in points], key


@_requires("mlflow")
def test_mlflow_file_store_holds_the_logged_metrics(tmp_path, tiny_model_path, monkeypatch):
    from mlflow.tracking import MlflowClient

    uri = (tmp_path / "mlruns").as_uri()
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    monkeypatch.setenv("MLFLOW_EXPERIMENT_NAME", "posttrain-test")
    logged = _train(tmp_path, tiny_model_path, "mlflow")
    client = MlflowClient(tracking_uri=uri)
    (run,) = client.search_runs([client.get_experiment_by_name("posttrain-test").experiment_id])
    assert run.info.status == "FINISHED"
    for key, points in logged.items():
        read = [(metric.step, metric.value) for metric in client.get_metric_history(run.info.run_id, key)]
        assert sorted(read) == points, key


def _wandb_records(path):
    """The records of a W&B run file: a LevelDB-style log (":W&B" header, 32 KiB blocks, each record split into
    chunks with a 7-byte header: checksum, length, type) of protobuf `Record`s."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:4] == b":W&B"
    position, block, pending = 7, 32768, b""
    while position + 7 <= len(data):
        if block - position % block < 7:  # block trailer too short for a header: padding
            position += block - position % block
            continue
        length, kind = int.from_bytes(data[position + 4 : position + 6], "little"), data[position + 6]
        pending += data[position + 7 : position + 7 + length]
        position += 7 + length
        if kind in (1, 4):  # a full record, or the last chunk of one
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            pending = b""
            yield record


@_requires("wandb")
def test_wandb_offline_run_holds_the_logged_metrics(tmp_path, tiny_model_path, monkeypatch):
    for name, value in {
        "WANDB_MODE": "offline",
        "WANDB_DIR": str(tmp_path),
        "WANDB_SILENT": "true",
        "WANDB_PROJECT": "posttrain-test",
        "WANDB_DISABLE_GIT": "true",
    }.items():
        monkeypatch.setenv(name, value)
    logged = _train(tmp_path, tiny_model_path, "wandb")
    import wandb

    wandb.finish()  # transformers leaves the run open for the process's exit to close; close it to read it
    (run_file,) = (tmp_path / "wandb").glob("offline-run-*/run-*.wandb")
    # wandb's service process writes the file; finish() can return before the last history records are on disk.
    deadline = time.monotonic() + 30
    while True:
        history = [
            {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item}
            for record in _wandb_records(run_file)
            if record.WhichOneof("record_type") == "history"
        ]
        if sum("train/loss" in row for row in history) >= len(logged["loss"]) or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    for key, points in logged.items():
        read = [(row["train/global_step"], row[f"train/{key}"]) for row in history if f"train/{key}" in row]
        assert read == points, key


@_requires("trackio")
def test_trackio_sqlite_holds_the_logged_metrics(tmp_path, tiny_model_path, monkeypatch):
    monkeypatch.setenv("TRACKIO_DIR", str(tmp_path / "trackio"))
    # trackio reads TRACKIO_DIR when imported, and its modules copy the value: point every copy at tmp_path.
    for name, module in list(sys.modules.items()):
        if name.split(".")[0] == "trackio" and hasattr(module, "TRACKIO_DIR"):
            monkeypatch.setattr(module, "TRACKIO_DIR", tmp_path / "trackio")
    from trackio.sqlite_storage import SQLiteStorage

    logged = _train(tmp_path, tiny_model_path, "trackio", project="posttrain-test", run_name="tiny-sft")
    assert SQLiteStorage.get_project_db_path("posttrain-test").is_relative_to(tmp_path)
    rows = SQLiteStorage.get_logs("posttrain-test", "tiny-sft")
    for key, points in logged.items():
        read = [(row["train/global_step"], row[f"train/{key}"]) for row in rows if f"train/{key}" in row]
        assert read == points, key


@pytest.mark.parametrize("tracker", ["wandb", "tensorboard", "mlflow", "trackio"])
def test_a_named_tracker_that_is_missing_names_the_extra(tmp_path, monkeypatch, tracker):
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a, **k: None)
    with pytest.raises(ConfigError, match=rf"pip install 'posttrain\[{tracker}\]'"):
        SFTConfig(output_dir=str(tmp_path), report_to=tracker, use_cpu=True)


def _grpo_with_completions(tmp_path, tiny_model_path, report_to):
    from posttrain import GRPOConfig, GRPOTrainer

    def short(completion_ids, **kwargs):
        return [-float(len(ids)) for ids in completion_ids]

    def has_the(completions, **kwargs):
        return [float(" the" in c) for c in completions]

    args = GRPOConfig(
        output_dir=str(tmp_path / "out"),
        per_device_train_batch_size=4,
        num_generations=2,
        max_completion_length=6,
        max_steps=2,
        logging_steps=1,
        save_strategy="no",
        report_to=report_to,
        use_cpu=True,
        bf16=False,
        disable_tqdm=True,
        log_completions=True,
        num_completions_to_print=2,
        write_report=False,
    )
    trainer = GRPOTrainer(
        tiny_model_path,
        [short, has_the],
        args=args,
        train_dataset=Dataset.from_list([{"prompt": f"count {i}"} for i in range(8)]),
    )
    trainer.train()
    return trainer


def _check_rows(columns, rows):
    assert columns == ["step", "prompt", "completion", "short", "has_the", "reward"] and len(rows) == 2
    for row in rows:
        assert row[-1] == pytest.approx(row[3] + row[4])  # the total is the sum of the per-function rewards


@_requires("tensorboard")
def test_completion_table_reaches_tensorboard(tmp_path, tiny_model_path, monkeypatch):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    monkeypatch.setenv("TENSORBOARD_LOGGING_DIR", str(tmp_path / "tb"))
    _grpo_with_completions(tmp_path, tiny_model_path, "tensorboard")
    events = EventAccumulator(str(tmp_path / "tb"), size_guidance={"tensors": 0})
    events.Reload()
    texts = [(e.step, e.tensor_proto.string_val[0].decode()) for e in events.Tensors("completions/text_summary")]
    assert [step for step, _ in texts] == [1, 2]
    lines = texts[0][1].splitlines()
    columns = [c.strip() for c in lines[0].strip("|").split("|")]
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in lines[2:]]
    _check_rows(columns, [[*row[:3], *(float(v) for v in row[3:])] for row in rows])


@_requires("mlflow")
def test_completion_table_reaches_mlflow(tmp_path, tiny_model_path, monkeypatch):
    from mlflow.tracking import MlflowClient

    uri = (tmp_path / "mlruns").as_uri()
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    monkeypatch.setenv("MLFLOW_EXPERIMENT_NAME", "posttrain-completions")
    _grpo_with_completions(tmp_path, tiny_model_path, "mlflow")
    client = MlflowClient(tracking_uri=uri)
    (run,) = client.search_runs([client.get_experiment_by_name("posttrain-completions").experiment_id])
    path = client.download_artifacts(run.info.run_id, "completions/step_000001.json", str(tmp_path / "dl"))
    table = json.loads(open(path).read())
    _check_rows(table["columns"], table["data"])
