"""A multi-turn game with feedback: SmolLM2-135M-Instruct learns to play guess-the-number through
``environment_factory=``.

Each rollout gets its own `GuessTheNumber` environment, reset with the dataset row's secret; its public method
``guess(number)`` is the model's tool and answers "higher", "lower" or "correct"; ``get_reward()`` gives 1.0 when
the secret was found, else partial credit for the share of wrong numbers the guesses ruled out (at most 0.5), so
that a group of games whose secrets were all missed still tells a guess that halves the range from one that does
not. A very short SFT warm-up (4 steps) on synthetic games (guesses that respect the feedback but are otherwise
random) shows the call format without making it reliable; GRPO then trains on the environment's reward.

Printed: the success rate and mean reward before training (on `before_size` games only: the untrained model calls
no tool), after the warm-up and after GRPO (on `eval_size` held-out games, every secret equally often, sampled at
temperature 1 with one fixed seed per game, so both evaluations play the same secrets with the same seeds and
GRPO's gain is a paired difference with its standard error), the GRPO metrics per step (reward, call frequency,
generation and update seconds) and each phase's time. For speed on a CPU the system turn lists the tool in one
line (47 prompt tokens instead of 260) and a game stops after its third call (the third answer is not rendered).

    OMP_NUM_THREADS=2 python examples/grpo_environment.py
"""

from __future__ import annotations

import argparse
import inspect
import random
import time

from datasets import Dataset
from grpo_tools import HISTORY_KEYS, MODEL, evaluate_episodes, grpo_config, tokenized_transcripts, warm_up

from posttrain import GRPOTrainer
from posttrain.chat_template_utils import add_response_schema, chatml_turns

LOW, HIGH = 1, 8
INSTRUCTION = f"Find my secret number ({LOW}-{HIGH}) with guess. I answer higher, lower or correct."
# Each tool in one line of the system turn, instead of the tool template's JSON schemas and call instructions (260
# prompt tokens in all with SmolLM2's tokenizer, 47 here): the warm-up teaches the call format, and on a CPU every
# step's cost is mostly the prompt, processed again for each turn of each game and in each update.
COMPACT_TOOLS_SYSTEM = (
    "{%- if tools %}{{- '<|im_start|>system\\nTools:' }}{%- for tool in tools %}"
    "{{- '\\n' + tool['function']['name'] + '(' + (tool['function']['parameters']['properties'] | list | join(', '))"
    " + '): ' + tool['function']['description'] }}{%- endfor %}{{- '<|im_end|>\\n' }}{%- endif %}"
)


def use_compact_tool_template(tokenizer):
    """ChatML with Hermes <tool_call> turns (as `use_chatml_tool_template`) but a one-line-per-tool system turn
    and no default system prompt. Returns the tokenizer."""
    tokenizer.chat_template = COMPACT_TOOLS_SYSTEM + chatml_turns(newline_in_generation=False)
    return add_response_schema(tokenizer)


class GuessTheNumber:
    """One game: `reset` gets the row's secret; `guess` is the only tool."""

    def reset(self, secret: int, **kwargs) -> None:
        self.secret, self.found, self.guesses = int(secret), False, 0
        self.low, self.high = LOW, HIGH  # the numbers the feedback so far leaves possible

    def guess(self, number: int) -> str:
        """Guess the secret number.

        Args:
            number: Your guess.
        """
        self.guesses += 1
        if number == self.secret:
            self.found = True
            return "correct"
        if number < self.secret:
            self.low = max(self.low, number + 1)
            return "higher"
        self.high = min(self.high, number - 1)
        return "lower"

    def get_reward(self) -> float:
        """1.0 when found; else half the share of the wrong numbers ruled out."""
        if self.found:
            return 1.0
        return 0.5 * (HIGH - LOW - (self.high - self.low)) / (HIGH - LOW)


def games(size: int, seed: int) -> Dataset:
    rng = random.Random(seed)
    return Dataset.from_list(
        [{"prompt": [{"role": "user", "content": INSTRUCTION}], "secret": rng.randint(LOW, HIGH)} for _ in range(size)]
    )


def held_out_games(size: int) -> Dataset:
    """Evaluation games: every secret equally often (in turn), so that a difference between models is not a
    difference in how many easy secrets a random draw gave."""
    return Dataset.from_list(
        [
            {"prompt": [{"role": "user", "content": INSTRUCTION}], "secret": LOW + i % (HIGH - LOW + 1)}
            for i in range(size)
        ]
    )


def transcript(secret: int, rng: random.Random, max_guesses: int, consistent: bool = True) -> list[dict]:
    """A game played by guessing at random: inside the range the feedback leaves open when `consistent` (never
    by halving it), else anywhere in LOW..HIGH, ignoring the feedback."""
    messages, low, high = [{"role": "user", "content": INSTRUCTION}], LOW, HIGH
    for _ in range(max_guesses):
        number = rng.randint(low, high) if consistent else rng.randint(LOW, HIGH)
        call = {"type": "function", "function": {"name": "guess", "arguments": {"number": number}}}
        answer = "correct" if number == secret else "higher" if number < secret else "lower"
        messages += [
            {"role": "assistant", "content": "", "tool_calls": [call]},
            {"role": "tool", "name": "guess", "content": answer},
        ]
        if answer == "correct":
            messages.append({"role": "assistant", "content": f"Found it: {number}."})
            return messages
        if consistent:
            low, high = (number + 1, high) if answer == "higher" else (low, number - 1)
    messages.append({"role": "assistant", "content": "I ran out of guesses."})
    return messages


def play(model, tokenizer, held_out: Dataset, max_completion_length: int, max_iterations: int) -> list[float]:
    """The reward of every held-out game, sampled at temperature 1 with one fixed seed per game: every game has
    the same prompt, so greedy decoding would play only 8 distinct games whatever the size. Game i gets the same
    secret and the same seed whatever the model, so two models' rewards are paired."""
    episodes = evaluate_episodes(
        model,
        tokenizer,
        held_out.to_list(),
        [],
        max_completion_length,
        max_iterations,
        environment_factory=GuessTheNumber,
        temperature=1.0,
    )
    return [e.info["reward"] for e in episodes]


def paired_gain(before: list[float], after: list[float]) -> tuple[float, float]:
    """Mean per-game gain (after - before) on the same games and seeds, and its standard error (the sample
    standard deviation of the per-game differences over sqrt(n))."""
    differences = [b - a for a, b in zip(before, after, strict=True)]
    n = len(differences)
    mean = sum(differences) / n
    if n < 2:
        return mean, float("nan")
    variance = sum((d - mean) ** 2 for d in differences) / (n - 1)
    return mean, (variance / n) ** 0.5


HISTORY = (*HISTORY_KEYS, "completions/mean_length", "time/generation", "time/update")


def run(
    model,
    tokenizer,
    *,
    sft_size: int = 128,
    sft_steps: int = 4,
    sft_consistent: bool = True,
    sft_learning_rate: float = 1e-4,
    grpo_steps: int = 8,
    before_size: int = 8,
    eval_size: int = 32,
    max_guesses: int = 3,
    max_completion_length: int = 144,
    episodes_per_step: int = 16,
    num_generations: int = 4,
    learning_rate: float = 5e-5,
    beta: float = 0.0,
    loss_type: str = "dapo",
    seed: int = 0,
    output_dir: str = "outputs/grpo_environment",
    log=print,
) -> dict:
    """The whole demo; returns the three success rates (and `<phase>_reward`, the mean rewards), the paired gain
    of GRPO over the warm-up with its standard error, the GRPO metrics per step and the phase times. The
    untrained model calls no tool, so its evaluation plays only `before_size` games. `seed` changes GRPO's games
    and sampling only (the warm-up and the evaluation games stay the same)."""
    use_compact_tool_template(tokenizer)
    results, times = {}, {}

    def timed(name, fn):
        start = time.perf_counter()
        value = fn()
        times[name] = round(time.perf_counter() - start, 1)
        return value

    def evaluate(phase, policy, size, took=""):
        rewards = timed(
            f"eval_{phase}", lambda: play(policy, tokenizer, held_out_games(size), max_completion_length, max_guesses)
        )
        results[f"{phase}_rewards"] = rewards
        results[phase] = sum(r == 1.0 for r in rewards) / len(rewards)
        results[f"{phase}_reward"] = sum(rewards) / len(rewards)
        log(
            f"{phase} ({size} games): success {results[phase]:.3f}, mean reward {results[f'{phase}_reward']:.3f} "
            f"({took}eval {times[f'eval_{phase}']} s)"
        )

    evaluate("before", model, before_size)
    rng = random.Random(1)
    sft_games = [transcript(rng.randint(LOW, HIGH), rng, max_guesses, sft_consistent) for _ in range(sft_size)]
    warm = tokenized_transcripts(tokenizer, sft_games, [GuessTheNumber().guess])
    model = timed("sft", lambda: warm_up(model, tokenizer, warm, sft_steps, f"{output_dir}/sft", sft_learning_rate))
    evaluate("after_sft", model, eval_size, f"SFT {times['sft']} s, ")
    trainer = GRPOTrainer(
        model,
        None,
        args=grpo_config(
            f"{output_dir}/grpo",
            grpo_steps,
            max_completion_length=max_completion_length,
            max_tool_calling_iterations=max_guesses,
            per_device_train_batch_size=episodes_per_step,
            num_generations=num_generations,
            beta=beta,
            loss_type=loss_type,
            learning_rate=learning_rate,
            seed=seed,
        ),
        train_dataset=games(grpo_steps * episodes_per_step // num_generations, seed=2 + seed),
        processing_class=tokenizer,
        environment_factory=GuessTheNumber,
    )
    timed("grpo", trainer.train)
    history = trainer.state.log_history
    results["grpo"] = {key: [round(h[key], 3) for h in history if key in h] for key in HISTORY}
    evaluate("after_grpo", trainer.model, eval_size, f"GRPO {times['grpo']} s, ")
    results["gain"], results["gain_se"] = paired_gain(results["after_sft_rewards"], results["after_grpo_rewards"])
    log(
        f"GRPO's paired gain in mean reward over the warm-up: {results['gain']:+.3f} "
        f"(standard error {results['gain_se']:.3f}, {eval_size} games)"
    )
    log(f"GRPO per step: {results['grpo']}")
    results["seconds"] = times
    return results


def main() -> None:
    from posttrain.models import load_causal_lm, load_tokenizer

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    defaults = {name: p.default for name, p in inspect.signature(run).parameters.items() if p.kind is p.KEYWORD_ONLY}
    helps = {
        "before_size": "games played by the untrained model (it calls no tool)",
        "eval_size": "held-out games after the warm-up and after GRPO (the same secrets and seeds for both)",
        "episodes_per_step": "games per GRPO step (num_generations per secret)",
        "learning_rate": "GRPO's learning rate",
        "sft_consistent": "1: the warm-up's random guesses respect the feedback; 0: they ignore it",
        "max_completion_length": "tokens per game, calls and answers included: three calls fit, the third "
        "answer does not (the game is over)",
    }
    for name in (
        "sft_steps",
        "sft_consistent",
        "grpo_steps",
        "before_size",
        "eval_size",
        "episodes_per_step",
        "num_generations",
        "learning_rate",
        "beta",
        "loss_type",
        "max_completion_length",
        "seed",
        "output_dir",
    ):
        kind = int if isinstance(defaults[name], bool) else type(defaults[name])
        parser.add_argument(f"--{name}", type=kind, default=defaults[name], help=helps.get(name))
    options = vars(parser.parse_args())
    options["sft_consistent"] = bool(options["sft_consistent"])
    start = time.perf_counter()
    results = run(load_causal_lm(MODEL), load_tokenizer(MODEL), **options)
    print(f"phase seconds: {results['seconds']}; total {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
