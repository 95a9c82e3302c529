"""TRL's example scripts with the import switched (scripts/trl_examples.sh): the harness itself, and three scripts
run on posttrain end to end (2 steps on tiny stand-ins) — a TRL example command that posttrain refuses fails here.
The whole set, side by side with TRL, is on docs/results/trl_examples.md."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from _trl import in_ci

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT.parent / "shared" / "trl-tests" / "examples" / "scripts"
sys.path.insert(0, str(ROOT / "scripts" / "trl_suite"))
import examples  # noqa: E402


def test_import_switch_rewrites_every_trl_import():
    source = (
        "import trl\nfrom trl import DPOConfig\nfrom trl.experimental.cpo import CPOTrainer\nimport trl.rewards\n"
        "import trlx\n"
    )
    assert examples.switch_imports(source) == (
        "import posttrain as trl\nfrom posttrain import DPOConfig\nfrom posttrain.experimental.cpo import CPOTrainer\n"
        "import posttrain.rewards, posttrain as trl\nimport trlx\n"
    )


def test_every_example_script_is_run_or_skipped_with_a_reason():
    if not EXAMPLES.is_dir():
        pytest.skip(f"TRL's example scripts are not at {EXAMPLES}")
    scripts = {p.name for p in EXAMPLES.glob("*.py")}
    folders = {p.name for p in EXAMPLES.iterdir() if p.is_dir()}
    assert scripts == set(examples.SCRIPTS) | set(examples.SKIPPED)
    assert folders <= set(examples.SKIPPED_FOLDERS)
    assert not set(examples.SCRIPTS) & set(examples.SKIPPED)


def test_a_loaded_model_with_model_init_kwargs_trains_with_a_warning(tmp_path, tiny_model_path, caplog):
    """TRL's sdft.py sets model_init_kwargs and passes a loaded model; TRL warns that they are unused and goes on."""
    import logging

    from datasets import Dataset
    from transformers import AutoModelForCausalLM

    from posttrain import SFTConfig, SFTTrainer

    model = AutoModelForCausalLM.from_pretrained(tiny_model_path)
    args = SFTConfig(output_dir=str(tmp_path), max_steps=1, report_to="none", model_init_kwargs={"dtype": "float32"})
    with caplog.at_level(logging.WARNING, logger="posttrain"):
        trainer = SFTTrainer(model, args=args, train_dataset=Dataset.from_list([{"text": "a b c"}] * 4))
    assert trainer.model is model and "model_init_kwargs" in caplog.text and "already loaded" in caplog.text


@pytest.mark.slow
def test_three_example_scripts_run_on_posttrain(tmp_path):
    if not EXAMPLES.is_dir():
        if in_ci():
            pytest.fail(f"CI=1: TRL's example scripts must be at {EXAMPLES}")
        pytest.skip(f"TRL's example scripts are not at {EXAMPLES}")
    scripts = ["cpo.py", "online_dpo.py", "prm.py"]
    run = subprocess.run(
        ["bash", "scripts/trl_examples.sh", "--lib", "posttrain", "--out", str(tmp_path), "--timeout", "400", *scripts],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=1500,
        env={**os.environ, "CI": ""},
    )
    results = json.loads((tmp_path / "posttrain.json").read_text())
    assert {name: r["status"] for name, r in results.items()} == dict.fromkeys(scripts, "passed"), run.stdout[-3000:]
