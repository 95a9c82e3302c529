"""The digits demo's command-line steps on a tiny LLaVA: `posttrain sft` then `posttrain grpo` with the YAML configs
of examples/vlm_digits_configs/, a JSON Lines dataset whose `images` column holds PNG paths, and the demo's
exact-match reward by import path. SFT trains the fresh tower (freeze_vision_tower: false in the config); GRPO
scores every completion with the demo's reward."""

import importlib
import json
from pathlib import Path

import pytest
import torch
from _vlm import image, vlm_paths  # noqa: F401
from transformers import AutoModelForImageTextToText

cli = importlib.import_module("posttrain.cli.main")  # the module (posttrain.cli.main is the function)


ROOT = Path(__file__).resolve().parents[2]
CONFIGS = ROOT / "examples" / "vlm_digits_configs"
SHORT = ["--max_steps", "1", "--logging_steps", "1", "--disable_tqdm", "true", "--use_cpu", "true"]


def write_data(tmp_path) -> tuple[Path, Path]:
    user = [{"role": "user", "content": "Which digit is this?"}]
    sft, grpo = tmp_path / "sft.jsonl", tmp_path / "grpo.jsonl"
    with open(sft, "w") as s, open(grpo, "w") as g:
        for i in range(8):
            path = tmp_path / f"{i}.png"
            image(i).save(path)
            s.write(
                json.dumps(
                    {"images": [str(path)], "prompt": user, "completion": [{"role": "assistant", "content": str(i)}]}
                )
                + "\n"
            )
            g.write(json.dumps({"images": [str(path)], "prompt": user, "answer": str(i)}) + "\n")
    return sft, grpo


def weights(path) -> dict[str, torch.Tensor]:
    return dict(AutoModelForImageTextToText.from_pretrained(path).named_parameters())


def moved(before: dict, after: dict, part: str) -> bool:
    return any(not torch.equal(value, after[name]) for name, value in before.items() if part in name)


@pytest.mark.slow  # two command-line runs (about 25 s on a quiet machine)
def test_sft_then_grpo_from_the_example_configs(tmp_path, vlm_paths, monkeypatch):
    monkeypatch.chdir(ROOT)  # the reward's import path, examples.vlm_digits, is relative to the repository root
    sft_data, grpo_data = write_data(tmp_path)
    base = weights(vlm_paths["llava"])
    sft_out = tmp_path / "sft"
    assert (
        cli.main(
            [
                "sft",
                "--config",
                str(CONFIGS / "sft.yaml"),
                "--model_name_or_path",
                vlm_paths["llava"],
                "--dataset_name",
                str(sft_data),
                "--output_dir",
                str(sft_out),
                "--per_device_train_batch_size",
                "4",
                "--warmup_steps",
                "0",
                *SHORT,
            ]
        )
        == 0
    )
    tuned = weights(sft_out)
    assert moved(base, tuned, "vision_tower")  # freeze_vision_tower: false in the config
    assert moved(base, tuned, "multi_modal_projector")

    grpo_out = tmp_path / "grpo"
    assert (
        cli.main(
            [
                "grpo",
                "--config",
                str(CONFIGS / "grpo.yaml"),
                "--model_name_or_path",
                str(sft_out),
                "--dataset_name",
                str(grpo_data),
                "--output_dir",
                str(grpo_out),
                "--learning_rate",
                "1e-3",
                "--per_device_train_batch_size",
                "8",
                "--num_generations",
                "4",
                "--log_completions",
                "true",
                "--dynamic_sampling",
                "false",
                "--warmup_steps",
                "0",
                *SHORT,
            ]
        )
        == 0
    )
    rows = [json.loads(line) for line in open(grpo_out / "completions.jsonl")]
    assert len(rows) == 8 and all(set(row["rewards"]) == {"exact_match"} for row in rows)  # the demo's reward
    log = [json.loads(line) for line in open(grpo_out / "metrics.jsonl")]
    assert any("rewards/exact_match/mean" in entry for entry in log)


def test_demo_accuracy_greedy_and_sampled(tmp_path, vlm_paths):
    """The demo's held-out measure: greedy, and sampled at temperature 1 with a fixed seed (the same draws for the
    same model, so two models are compared on the same randomness). Counted by hand from the replies."""
    import sys

    from transformers import AutoProcessor

    sys.path.insert(0, str(ROOT / "examples"))
    import vlm_digits

    path = vlm_paths["llava"]
    model, processor = AutoModelForImageTextToText.from_pretrained(path), AutoProcessor.from_pretrained(path)
    samples = []
    for i in range(6):
        image(i).save(tmp_path / f"{i}.png")
        samples.append((str(tmp_path / f"{i}.png"), i))
    replies = []
    real_decode = processor.batch_decode
    processor.batch_decode = lambda *a, **k: replies.append(real_decode(*a, **k)) or replies[-1]
    for temperature in (None, 1.0, 1.0):
        got = vlm_digits.accuracy(model, processor, samples, batch_size=4, temperature=temperature)
        texts = replies[-2] + replies[-1]  # two batches: 4 + 2 samples
        right = sum(bool(m := vlm_digits.DIGIT.search(t)) and m.group() == str(d) for t, (_, d) in zip(texts, samples))
        assert got == right / len(samples)
    assert replies[2:4] == replies[4:6]  # seeded: the same draws again
    assert replies[0:2] != replies[2:4]  # and not greedy's


def test_paired_flips_mcnemar_exact():
    """The demo's paired comparison of SFT and GRPO on the same digits, checked by hand: only the changed verdicts
    count, and the p-value is the two-sided binomial tail of their split."""
    import sys

    sys.path.insert(0, str(ROOT / "examples"))
    import vlm_digits

    before = [True, True, False, False, True, False]
    after = [True, False, True, True, True, False]
    # one right -> wrong (the second), two wrong -> right (third, fourth): 3 changes split 1 / 2, as even as can be
    assert vlm_digits.paired_flips(before, after) == (1, 2, 1.0)
    # 0 / 5: P(split at least this uneven) = 2 x (1/2)^5 = 1/16
    assert vlm_digits.paired_flips([False] * 5 + [True], [True] * 6) == (0, 5, 0.0625)
    # 1 / 7: 2 x (C(8,0) + C(8,1)) / 2^8 = 18/256
    assert vlm_digits.paired_flips([True] + [False] * 7, [False] + [True] * 7) == (1, 7, 18 / 256)
    assert vlm_digits.paired_flips([True, False], [True, False]) == (0, 0, 1.0)  # nothing changed
    assert vlm_digits.paired_flips([True, False], [False, True])[:2] == (1, 1)


def test_script_grpo_defaults_are_the_config():
    """examples/vlm_digits.py's GRPO defaults and examples/vlm_digits_configs/grpo.yaml describe the same run."""
    import sys

    import yaml

    sys.path.insert(0, str(ROOT / "examples"))
    import vlm_digits

    config = yaml.safe_load(open(CONFIGS / "grpo.yaml"))
    args = vlm_digits.arguments().parse_args([])
    assert config["per_device_train_batch_size"] == args.grpo_prompts * args.num_generations  # counts completions
    assert config["num_generations"] == args.num_generations
    assert config["learning_rate"] == args.grpo_learning_rate
    assert config["lr_scheduler_type"] == args.grpo_scheduler
    assert config["warmup_steps"] == args.grpo_warmup_steps
    assert config["beta"] == args.grpo_beta
    assert config["max_steps"] == args.grpo_steps
    assert config["seed"] == args.seed
    sft = yaml.safe_load(open(CONFIGS / "sft.yaml"))
    assert sft["max_steps"] == args.sft_steps
