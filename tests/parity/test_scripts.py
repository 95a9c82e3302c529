"""TRL 1.16's own training scripts run on posttrain: `trl/scripts/{sft,dpo,kto,reward,grpo,rloo,distillation}.py`
are read from
the installed TRL at test time (never stored in this repository), their `trl` imports rewritten to `posttrain`,
and each is run as a subprocess with a YAML `--config` plus flags on local JSONL data and the tiny model, for two
steps; each must finish and save a model that loads. All seven start at once, so the file takes about as long as
the slowest one."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

SCRIPTS = ("sft", "dpo", "kto", "reward", "grpo", "rloo", "distillation")
TIMEOUT_S = 240
ENV = {
    **os.environ,
    "OMP_NUM_THREADS": "1",
    "TOKENIZERS_PARALLELISM": "false",
    "HF_HUB_OFFLINE": "1",
    "HF_DATASETS_OFFLINE": "1",
}

# `from trl import X`, `from trl.rewards import Y`, `import trl` -> posttrain.
TRL_IMPORT = re.compile(r"^(\s*)(from|import)\s+trl\b", flags=re.MULTILINE)

SFT_ROWS = [
    {"prompt": f"{i % 5} plus {(i * 3) % 5} equals", "completion": f" {i % 5 + (i * 3) % 5}"} for i in range(12)
]
PREFERENCE_ROWS = [
    {"prompt": f"{i} plus {i} is", "chosen": f" {2 * i}", "rejected": f" {2 * i + 1}"} for i in range(12)
]
PROMPT_ROWS = [{"prompt": f"say {i}"} for i in range(12)]
DATA = {
    "sft": SFT_ROWS,
    "dpo": PREFERENCE_ROWS,
    "kto": PREFERENCE_ROWS,
    "reward": PREFERENCE_ROWS,
    "grpo": PROMPT_ROWS,
    "rloo": PROMPT_ROWS,
    "distillation": PROMPT_ROWS,
}
# Per script: extra YAML settings; the flags below override the YAML's max_steps (5 -> 2).
# The online scripts import the reward by its dotted path from the working directory (TRL's script puts it on
# sys.path); the reward varies with the completion's length, so the advantages are not all zero.
EXTRA = {
    "grpo": {"num_generations": 2, "max_completion_length": 6, "reward_funcs": ["my_rewards.length_reward"]},
    "rloo": {"num_generations": 2, "max_completion_length": 6, "reward_funcs": ["my_rewards.length_reward"]},
    "distillation": {"max_completion_length": 6},  # the teacher (the tiny model itself) is set in `runs`
}
# Records the YAML's `env:` value as the script process sees it.
REWARD_MODULE = """import os
from pathlib import Path


def length_reward(completions, **kwargs):
    Path("env_seen_" + os.environ.get("POSTTRAIN_TEST_MARKER", "unset")).touch()
    return [len(str(completion)) / 10 for completion in completions]
"""


def trl_script_source(name: str) -> str:
    """TRL's script text with its trl imports pointed at posttrain."""
    spec = importlib.util.find_spec("trl")
    source = (Path(spec.origin).parent / "scripts" / f"{name}.py").read_text(encoding="utf-8")
    return TRL_IMPORT.sub(lambda match: f"{match.group(1)}{match.group(2)} posttrain", source)


def _write_jsonl(path: Path, rows: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))


@pytest.fixture(scope="module")
def runs(tmp_path_factory, tiny_model_path):
    """All the scripts started together; `runs(name)` waits for one: (exit status, output, output_dir)."""
    if importlib.util.find_spec("trl") is None:
        pytest.skip("trl is not installed: TRL's scripts are read from the installed package")
    root = tmp_path_factory.mktemp("trl_scripts")
    (root / "my_rewards.py").write_text(REWARD_MODULE)
    started = {}
    for name in SCRIPTS:
        script = root / f"{name}.py"
        script.write_text(trl_script_source(name))
        # A dataset directory: datasets.load_dataset(dir) finds its train split by the file name, as on the Hub.
        _write_jsonl(root / f"data_{name}" / "train.jsonl", DATA[name])
        config = {
            "model_name_or_path": tiny_model_path,
            "dataset_name": str(root / f"data_{name}"),
            "max_steps": 5,
            "learning_rate": 1e-2,
            "per_device_train_batch_size": 4,
            "logging_steps": 1,
            "save_strategy": "no",
            "report_to": "none",
            "seed": 0,
            "disable_tqdm": True,
            "env": {"POSTTRAIN_TEST_MARKER": name},
            **EXTRA.get(name, {}),
        }
        if name == "distillation":
            config["teacher_model_name_or_path"] = tiny_model_path
        (root / f"{name}.yaml").write_text(yaml.safe_dump(config))
        argv = [
            sys.executable,
            str(script),
            "--config",
            str(root / f"{name}.yaml"),
            "--max_steps",
            "2",
            "--output_dir",
            str(root / f"out_{name}"),
        ]
        log = open(root / f"{name}.log", "w")
        started[name] = (subprocess.Popen(argv, cwd=root, env=ENV, stdout=log, stderr=subprocess.STDOUT), log)

    def result(name):
        process, log = started[name]
        status = process.wait(timeout=TIMEOUT_S)
        log.close()
        return status, (root / f"{name}.log").read_text(), root / f"out_{name}"

    yield result
    for process, log in started.values():
        if process.poll() is None:
            process.kill()
        log.close()


def test_trl_imports_are_rewritten():
    if importlib.util.find_spec("trl") is None:
        pytest.skip("trl is not installed")
    for name in SCRIPTS:
        source = trl_script_source(name)
        assert not re.search(r"^\s*(from|import)\s+trl\b", source, flags=re.MULTILINE), name
        assert "from posttrain import" in source


@pytest.mark.parametrize("name", SCRIPTS)
def test_trl_script_trains_and_saves_a_model(runs, tiny_model_path, name):
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    status, output, out = runs(name)
    assert status == 0, output[-4000:]
    assert "Training completed" in output and f"Model saved to {out}" in output
    # One log line per step (logging_steps 1): the flag's max_steps 2 overrode the YAML's 5.
    assert output.count("{'loss'") == 2, output[-4000:]
    if "reward_funcs" in EXTRA.get(name, {}):  # the YAML's env: section reached the process before the reward ran
        assert (out.parent / f"env_seen_{name}").is_file()
    model_class = AutoModelForSequenceClassification if name == "reward" else AutoModelForCausalLM
    trained = model_class.from_pretrained(out)
    original = AutoModelForCausalLM.from_pretrained(tiny_model_path).get_input_embeddings().weight
    # Two steps at lr 1e-2 moved the weights (the reward model's embeddings start from the same checkpoint).
    assert not torch.equal(trained.get_input_embeddings().weight, original)
