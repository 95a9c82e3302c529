"""A cost model per trainer: step time ~ a + b * tokens (+ c * tokens^2 where attention shows), fitted to the
scaling curves that benchmarks/bench_scaling.py measures, so that a run's time can be predicted before it starts.

The coefficients live in cost_model.json beside this module (written by `benchmarks/scaling_report.py --fit`), each
with the model, the settings and the machine it was measured on. `estimate(config)` scales them to another model by
its parameter count (the linear term: matmul FLOPs grow with parameters x tokens) and its layers x width (the
quadratic term: attention scores); `posttrain env --estimate CONFIG` prints the result.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

COEFFICIENTS = Path(__file__).with_name("cost_model.json")
SMOLLM2_PARAMS = 134_515_008  # the built-in SmolLM2-135M-Instruct (tied embeddings)
SMOLLM2_SHAPE = {"hidden_size": 576, "num_hidden_layers": 30, "params": SMOLLM2_PARAMS}


def fit(tokens: list[float], seconds: list[float], quadratic: bool = False) -> tuple[float, float, float]:
    """Least-squares (a, b, c) of seconds ~ a + b * tokens + c * tokens^2 (c = 0 unless `quadratic`). Needs at
    least as many distinct points as coefficients."""
    columns = 3 if quadratic else 2
    if len(set(tokens)) < columns or len(tokens) != len(seconds):
        raise ValueError(f"fit needs at least {columns} distinct token counts, one time each; got {len(set(tokens))}")
    # Scale tokens to ~1 so that the normal equations stay well conditioned.
    scale = max(abs(t) for t in tokens)
    rows = [[(t / scale) ** k for k in range(columns)] for t in tokens]
    gram = [[sum(r[i] * r[j] for r in rows) for j in range(columns)] for i in range(columns)]
    rhs = [sum(r[i] * s for r, s in zip(rows, seconds)) for i in range(columns)]
    solution = _solve(gram, rhs)
    coefficients = [solution[k] / scale**k for k in range(columns)] + [0.0] * (3 - columns)
    return coefficients[0], coefficients[1], coefficients[2]


def _solve(matrix: list[list[float]], rhs: list[float]) -> list[float]:
    """Gaussian elimination with partial pivoting (the systems here are 2x2 or 3x3)."""
    n = len(rhs)
    augmented = [row[:] + [value] for row, value in zip(matrix, rhs)]
    for column in range(n):
        pivot = max(range(column, n), key=lambda r: abs(augmented[r][column]))
        augmented[column], augmented[pivot] = augmented[pivot], augmented[column]
        if augmented[column][column] == 0:
            raise ValueError("fit: the points do not determine the coefficients (singular system)")
        for row in range(column + 1, n):
            factor = augmented[row][column] / augmented[column][column]
            augmented[row] = [x - factor * y for x, y in zip(augmented[row], augmented[column])]
    solution = [0.0] * n
    for row in reversed(range(n)):
        known = sum(augmented[row][k] * solution[k] for k in range(row + 1, n))
        solution[row] = (augmented[row][n] - known) / augmented[row][row]
    return solution


def parameter_count(config: dict[str, Any]) -> int:
    """Parameters of a decoder-only transformer from its config.json fields (embeddings, attention with grouped
    key-value heads, a gated MLP, the output layer unless tied)."""
    hidden, layers = config["hidden_size"], config["num_hidden_layers"]
    heads = config.get("num_attention_heads", 1)
    head_dim = config.get("head_dim") or hidden // heads
    kv = config.get("num_key_value_heads") or heads
    attention = hidden * heads * head_dim * 2 + hidden * kv * head_dim * 2
    mlp = 3 * hidden * config.get("intermediate_size", 4 * hidden)
    embeddings = config["vocab_size"] * hidden * (1 if config.get("tie_word_embeddings", True) else 2)
    return layers * (attention + mlp + 2 * hidden) + embeddings + hidden


@dataclass
class Estimate:
    trainer: str
    tokens_per_step: int
    step_s: float
    steps: int | None
    basis: str  # what the coefficients were measured on

    @property
    def run_s(self) -> float | None:
        return None if self.steps is None else self.step_s * self.steps


def load_coefficients(path: Path = COEFFICIENTS) -> dict[str, Any]:
    return json.loads(path.read_text()) if path.exists() else {"trainers": {}}


def model_shape(name: str) -> dict[str, int]:
    """hidden size, layers and parameters of a model: the built-in SmolLM2, or a local directory's config.json."""
    if name.startswith("builtin:"):
        return SMOLLM2_SHAPE
    config_path = Path(name) / "config.json"
    if not config_path.exists():
        raise ValueError(
            f"model_name_or_path={name!r}: the estimate reads the model's shape from a local config.json and found "
            "none; point model_name_or_path at a local checkpoint directory (or builtin:SmolLM2-135M-Instruct)."
        )
    config = json.loads(config_path.read_text())
    config = config.get("text_config", config)
    return {
        "hidden_size": config["hidden_size"],
        "num_hidden_layers": config["num_hidden_layers"],
        "params": parameter_count(config),
    }


def tokens_per_step(trainer: str, config: dict[str, Any]) -> int:
    """Tokens one optimizer step processes at most: rows x max_length (x2 for a preference pair; GRPO: the
    completions, which dominate its time)."""
    rows = config.get("per_device_train_batch_size", 8) * config.get("gradient_accumulation_steps", 1)
    if trainer == "grpo":
        return rows * config.get("max_completion_length", 256)
    pairs = 2 if trainer in ("dpo", "reward") else 1
    return rows * config.get("max_length", 1024) * pairs


def estimate(trainer: str, config: dict[str, Any], coefficients: dict[str, Any] | None = None) -> Estimate:
    """The predicted step time of a run of `trainer` with the settings in `config` (a config file's keys)."""
    table = (coefficients or load_coefficients())["trainers"]
    if trainer not in table:
        raise ValueError(
            f"no cost model for trainer {trainer!r} (fitted: {', '.join(sorted(table)) or 'none'}); run "
            "benchmarks/bench_scaling.py and benchmarks/scaling_report.py --fit to measure one."
        )
    fitted = table[trainer]
    shape = model_shape(config.get("model_name_or_path", "builtin:SmolLM2-135M-Instruct"))
    width = shape["hidden_size"] * shape["num_hidden_layers"] / (fitted["hidden_size"] * fitted["num_hidden_layers"])
    tokens = tokens_per_step(trainer, config)
    linear = fitted["b"] * shape["params"] / fitted["params"]
    lora_factor = 1.0 if bool(config.get("use_peft")) == fitted["lora"] else (1.5 if fitted["lora"] else 2 / 3)
    step = fitted["a"] + (linear * tokens + fitted["c"] * width * tokens**2) * lora_factor
    return Estimate(trainer, tokens, step, config.get("max_steps"), fitted["basis"])
