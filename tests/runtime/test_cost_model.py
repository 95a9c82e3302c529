"""The cost model (posttrain/runtime/cost_model.py) and `posttrain env --estimate`: the fit recovers known
coefficients, the parameter count agrees with a built model's, the estimate follows the formula, and the CLI
prints a prediction for the shipped SFT example."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from posttrain.cli.estimate import estimate_report
from posttrain.cli.main import main as cli_main
from posttrain.errors import ConfigError
from posttrain.runtime import cost_model

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def test_fit_recovers_linear_coefficients():
    tokens = [512, 1024, 2048, 4096]
    seconds = [0.4 + 0.002 * t for t in tokens]
    a, b, c = cost_model.fit(tokens, seconds)
    assert a == pytest.approx(0.4, rel=1e-9) and b == pytest.approx(0.002, rel=1e-9) and c == 0.0


def test_fit_recovers_quadratic_coefficients_under_noise():
    rng = random.Random(0)
    tokens = [256 * k for k in range(1, 17)]
    truth = (1.5, 3e-3, 2e-7)
    seconds = [(truth[0] + truth[1] * t + truth[2] * t * t) * (1 + rng.uniform(-1e-3, 1e-3)) for t in tokens]
    a, b, c = cost_model.fit(tokens, seconds, quadratic=True)
    assert a == pytest.approx(truth[0], rel=0.05)
    assert b == pytest.approx(truth[1], rel=0.02)
    assert c == pytest.approx(truth[2], rel=0.02)


def test_fit_needs_enough_points():
    with pytest.raises(ValueError, match="at least 3 distinct"):
        cost_model.fit([512, 1024], [1.0, 2.0], quadratic=True)


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_parameter_count_matches_a_built_model(tmp_path, family):
    from posttrain.models.tiny import save_tiny_model

    path = save_tiny_model(tmp_path / family, family=family, hidden_size=64, num_layers=3, tie=False)
    config = json.loads((Path(path) / "config.json").read_text())
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path)
    biases = sum(p.numel() for name, p in model.named_parameters() if name.endswith(".bias"))  # Qwen2's q/k/v
    assert cost_model.parameter_count(config) + biases == sum(p.numel() for p in model.parameters())


def test_estimate_follows_the_fitted_line_and_scales_with_the_model(tmp_path):
    fitted = {"a": 0.5, "b": 0.01, "c": 0.0, "lora": True, "basis": "test", **cost_model.SMOLLM2_SHAPE}
    table = {"trainers": {"sft": fitted}}
    config = {"model_name_or_path": "builtin:SmolLM2-135M-Instruct", "use_peft": True, "max_length": 256}
    config.update(per_device_train_batch_size=4, max_steps=10)
    result = cost_model.estimate("sft", config, table)
    assert result.tokens_per_step == 1024
    assert result.step_s == pytest.approx(0.5 + 0.01 * 1024)
    assert result.run_s == pytest.approx(10 * result.step_s)
    # SmolLM2's own config.json gives its parameter count; fitted on a model of half as many parameters, the
    # per-token term doubles and the fixed cost stays.
    smollm2 = dict(hidden_size=576, num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3)
    smollm2.update(intermediate_size=1536, vocab_size=49152, tie_word_embeddings=True)
    (tmp_path / "config.json").write_text(json.dumps(smollm2))
    assert cost_model.model_shape(str(tmp_path))["params"] == cost_model.SMOLLM2_PARAMS
    half = {"trainers": {"sft": dict(fitted, params=cost_model.SMOLLM2_PARAMS / 2)}}
    result = cost_model.estimate("sft", dict(config, model_name_or_path=str(tmp_path)), half)
    assert result.step_s == pytest.approx(0.5 + 2 * 0.01 * 1024)


def test_estimate_names_a_missing_trainer():
    with pytest.raises(ValueError, match="no cost model for trainer 'kto'"):
        cost_model.estimate("kto", {}, {"trainers": {"sft": {}}})


def test_cli_prints_an_estimate_for_the_sft_example(capsys):
    assert cli_main(["env", "--estimate", str(EXAMPLES / "sft_smollm2.yaml")]) == 0
    out = capsys.readouterr().out
    assert "(sft): 1024 tokens per step at most" in out  # 4 rows x max_length 256
    step = float(out.split("step time: ")[1].split(" s")[0])
    fitted = cost_model.load_coefficients()["trainers"]["sft"]
    assert step == pytest.approx(fitted["a"] + fitted["b"] * 1024 + fitted["c"] * 1024**2, abs=0.01)
    assert "run time:" in out and "max_steps=40" in out


def test_cli_estimate_asks_for_the_trainer_when_the_name_does_not_say(tmp_path, capsys):
    config = tmp_path / "my_run.yaml"
    config.write_text("model_name_or_path: builtin:SmolLM2-135M-Instruct\n")
    assert cli_main(["env", "--estimate", str(config)]) != 0
    assert "cannot tell the trainer from the file name" in capsys.readouterr().err
    with pytest.raises(ConfigError, match="add --trainer"):
        estimate_report(str(config))
