"""Text GRPO side by side with TRL 1.16: the same tiny Llama, chat prompts and completions (injected into both
trainers' generation, so that sampling plays no part) give the same loss, gradient norm and logged metrics at every
step: to 1e-5 at the first step, to 1e-3 after it (at lr 0.05 an update amplifies float rounding; TRL's own
second-step gradient norm moves by 1e-4 between one and two threads, and the two posttrain routes land on either
side of it). This is the path the time-to-accuracy benchmark trains on: posttrain computes each group's prompt once
in its log-prob forwards (online/logps.py), TRL runs the padded batch with gradient checkpointing."""

import pytest
from _trl import import_trl
from datasets import Dataset

from posttrain import GRPOConfig, GRPOTrainer
from posttrain.generation.base import Completion

# Logged by one trainer only, or wall-clock times.
NOT_COMPARED = {
    "step_time",
    "time/generation",
    "time/scoring",
    "time/update",
    "frac_reward_none",
    "advantages/mean",
    "advantages/std",
    "train_runtime",
    "train_samples_per_second",
    "train_steps_per_second",
    "total_flos",
    "learning_rate",
}


def prompts() -> Dataset:
    # Prompts of different lengths, so that the padded batch and the shared-prompt layout differ.
    return Dataset.from_list([{"prompt": [{"role": "user", "content": "add" + " one" * i}]} for i in range(4)])


def completion_table(eos: int) -> dict[int, list[list[int]]]:
    """Per prompt (keyed by its number of " one"), its four completions: ended by EOS, cut at the length limit, or
    shorter; the same token ids for every prompt would hide a mix-up, so each prompt has its own."""
    return {k: [[30 + k, 31, eos], [40 + k, 41, 42, 43, 44], [50 + k], [60 + k, 61, 62, eos]] for k in range(4)}


def length_reward(completions, **kwargs):
    return [float(len(c[0]["content"])) for c in completions]


def settings(tmp_path, name, loss_type, beta):
    return dict(
        output_dir=str(tmp_path / name),
        per_device_train_batch_size=8,
        num_generations=4,
        max_completion_length=5,
        num_iterations=2,
        max_steps=4,
        beta=beta,
        epsilon=0.05,
        learning_rate=0.05,
        loss_type=loss_type,
        logging_steps=1,
        report_to="none",
        use_cpu=True,
        bf16=False,
        save_strategy="no",
        seed=0,
        disable_tqdm=True,
    )


def logged(trainer) -> list[dict]:
    return [
        {k: v for k, v in log.items() if k not in NOT_COMPARED} for log in trainer.state.log_history if "loss" in log
    ]


@pytest.mark.parametrize("loss_type, beta", [("dapo", 0.0), ("grpo", 0.2)])
def test_grpo_matches_trl_on_the_same_prompts_and_completions(tmp_path, tiny_model_path, tokenizer, loss_type, beta):
    trl = import_trl("grpo_config", "grpo_trainer")
    table = completion_table(tokenizer.eos_token_id)

    def completions_of(prompt_ids):
        taken, out = {}, []
        for ids in prompt_ids:
            key = tokenizer.decode(ids).count(" one")
            out.append(table[key][taken.get(key, 0) % 4])
            taken[key] = taken.get(key, 0) + 1
        return out

    theirs = trl.GRPOTrainer(
        tiny_model_path,
        reward_funcs=length_reward,
        train_dataset=prompts(),
        args=trl.GRPOConfig(**settings(tmp_path, "trl", loss_type, beta)),
    )
    theirs._generate_single_turn = lambda prompt_ids, *args, **kwargs: (completions_of(prompt_ids), None)
    theirs.train()

    ours = GRPOTrainer(
        tiny_model_path,
        reward_funcs=length_reward,
        train_dataset=prompts(),
        args=GRPOConfig(**settings(tmp_path, "ours", loss_type, beta)),
    )

    def our_generation(prompt_ids, n, sampling, seeds, vision=None, suppress_tokens=None):
        ids = completions_of([p for p in prompt_ids for _ in range(n)])
        return [Completion(i // n, c, None, c[-1] == tokenizer.eos_token_id) for i, c in enumerate(ids)]

    ours.generation_backend.generate = our_generation
    ours.train()

    expected, got = logged(theirs), logged(ours)
    assert len(expected) == len(got) == 4
    assert expected[1]["clip_ratio/region_mean"] > 0  # the re-used round's ratio is not trivial
    for step, (theirs_log, ours_log) in enumerate(zip(expected, got)):
        missing = set(theirs_log) - set(ours_log)
        assert not missing, f"posttrain does not log {missing}"
        tolerance = 1e-5 if step == 0 else 1e-3
        for key, value in theirs_log.items():
            assert ours_log[key] == pytest.approx(value, rel=tolerance, abs=tolerance), (step, key)
