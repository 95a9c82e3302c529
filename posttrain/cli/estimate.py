"""`posttrain env --estimate CONFIG`: the predicted step and run time of a config file, from the cost model
(posttrain/runtime/cost_model.py) fitted to the scaling curves of docs/results/scaling.md."""

from __future__ import annotations

from pathlib import Path

from posttrain.errors import ConfigError
from posttrain.runtime.cost_model import estimate, load_coefficients

TRAINERS = ("sft", "dpo", "reward", "kto", "grpo", "rloo", "ppo")


def _trainer_of(path: Path, trainer: str | None) -> str:
    if trainer is not None:
        return trainer.lower()
    guess = path.stem.split("_")[0].lower()
    if guess not in TRAINERS:
        raise ConfigError(
            f"--estimate {path}: cannot tell the trainer from the file name (it starts with {guess!r}); "
            f"add --trainer, one of {', '.join(TRAINERS)}."
        )
    return guess


def _duration(seconds: float) -> str:
    minutes, secs = divmod(round(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h {minutes:02d}m {secs:02d}s" if hours else f"{minutes}m {secs:02d}s"


def estimate_report(config_path: str, trainer: str | None = None) -> str:
    import yaml

    path = Path(config_path)
    if not path.is_file():
        raise ConfigError(f"--estimate {config_path}: no such config file.")
    config = yaml.safe_load(path.read_text()) or {}
    name = _trainer_of(path, trainer)
    try:
        result = estimate(name, config, load_coefficients())
    except ValueError as err:
        raise ConfigError(f"--estimate {config_path}: {err}") from err
    lines = [
        f"estimate for {path} ({name}): {result.tokens_per_step} tokens per step at most",
        f"  step time: {result.step_s:.2f} s",
    ]
    if result.run_s is not None:
        lines.append(f"  run time: {_duration(result.run_s)} for max_steps={result.steps} (training steps only)")
    lines.append(f"  measured on: {result.basis}")
    return "\n".join(lines)
