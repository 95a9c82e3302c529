"""A multi-turn game with feedback: SmolLM2-135M-Instruct learns to play guess-the-number through
``environment_factory=``.

Each rollout gets its own `GuessTheNumber` environment, reset with the dataset row's secret; its public method
``guess(number)`` is the model's tool and answers "higher", "lower" or "correct"; ``get_reward()`` gives 1.0 when
the secret was found. A short SFT warm-up on synthetic games (guesses that respect the feedback but are otherwise
random) teaches the call format, then GRPO trains on the environment's reward. The held-out success rate (sampled
at temperature 1, fixed seeds) is printed before, after the warm-up and after GRPO, with the reward per GRPO step.

    OMP_NUM_THREADS=2 python examples/grpo_environment.py
"""

from __future__ import annotations

import argparse
import random
import time

from datasets import Dataset
from grpo_tools import MODEL, evaluate_episodes, grpo_config, grpo_history, tokenized_transcripts, warm_up

from posttrain import GRPOTrainer
from posttrain.tools import use_chatml_tool_template

LOW, HIGH = 1, 8
INSTRUCTION = (f"I picked a secret whole number from {LOW} to {HIGH}. Find it with the guess tool: after each "
               "guess I say higher, lower or correct.")


class GuessTheNumber:
    """One game: `reset` gets the row's secret; `guess` is the only tool."""

    def reset(self, secret: int, **kwargs) -> None:
        self.secret, self.found, self.guesses = int(secret), False, 0

    def guess(self, number: int) -> str:
        """Guess the secret number.

        Args:
            number: Your guess, a whole number in the game's range.
        """
        self.guesses += 1
        if number == self.secret:
            self.found = True
            return "correct"
        return "higher" if number < self.secret else "lower"

    def get_reward(self) -> float:
        return float(self.found)


def games(size: int, seed: int) -> Dataset:
    rng = random.Random(seed)
    return Dataset.from_list([{"prompt": [{"role": "user", "content": INSTRUCTION}], "secret": rng.randint(LOW, HIGH)}
                              for _ in range(size)])


def transcript(secret: int, rng: random.Random, max_guesses: int) -> list[dict]:
    """A game played by guessing at random inside the range the feedback leaves open (not by halving it)."""
    messages, low, high = [{"role": "user", "content": INSTRUCTION}], LOW, HIGH
    for _ in range(max_guesses):
        number = rng.randint(low, high)
        call = {"type": "function", "function": {"name": "guess", "arguments": {"number": number}}}
        answer = "correct" if number == secret else "higher" if number < secret else "lower"
        messages += [{"role": "assistant", "content": "", "tool_calls": [call]},
                     {"role": "tool", "name": "guess", "content": answer}]
        if answer == "correct":
            messages.append({"role": "assistant", "content": f"Found it: {number}."})
            return messages
        low, high = (number + 1, high) if answer == "higher" else (low, number - 1)
    messages.append({"role": "assistant", "content": "I ran out of guesses."})
    return messages


def success_rate(model, tokenizer, held_out: Dataset, max_completion_length: int, max_iterations: int) -> float:
    """The policy's mean reward on the held-out games, sampled at temperature 1 with fixed seeds: every game has
    the same prompt, so greedy decoding would play only 8 distinct games whatever eval_size is."""
    episodes = evaluate_episodes(model, tokenizer, held_out.to_list(), [], max_completion_length, max_iterations,
                                 environment_factory=GuessTheNumber, temperature=1.0)
    return sum(e.info["reward"] for e in episodes) / len(episodes)


def run(model, tokenizer, *, sft_size: int = 128, sft_steps: int = 16, grpo_steps: int = 10, eval_size: int = 64,
        max_guesses: int = 3, max_completion_length: int = 160, output_dir: str = "outputs/grpo_environment",
        log=print) -> dict:
    """The whole demo; returns the three success rates, the GRPO metrics per step and the phase times."""
    use_chatml_tool_template(tokenizer)
    held_out = games(eval_size, seed=1234)
    results, times = {}, {}

    def timed(name, fn):
        start = time.perf_counter()
        value = fn()
        times[name] = round(time.perf_counter() - start, 1)
        return value

    def rate(policy):
        return success_rate(policy, tokenizer, held_out, max_completion_length, max_guesses)

    results["before"] = timed("eval_before", lambda: rate(model))
    log(f"success before: {results['before']:.3f} ({times['eval_before']} s)")
    rng = random.Random(1)
    sft_games = [transcript(rng.randint(LOW, HIGH), rng, max_guesses) for _ in range(sft_size)]
    warm = tokenized_transcripts(tokenizer, sft_games, [GuessTheNumber().guess])
    model = timed("sft", lambda: warm_up(model, tokenizer, warm, sft_steps, f"{output_dir}/sft", 1e-4))
    results["after_sft"] = timed("eval_sft", lambda: rate(model))
    log(f"success after SFT: {results['after_sft']:.3f} (SFT {times['sft']} s, eval {times['eval_sft']} s)")
    trainer = GRPOTrainer(model, None, args=grpo_config(f"{output_dir}/grpo", grpo_steps,
                                                        max_completion_length=max_completion_length,
                                                        max_tool_calling_iterations=max_guesses),
                          train_dataset=games(grpo_steps * 8, seed=2), processing_class=tokenizer,
                          environment_factory=GuessTheNumber)
    timed("grpo", trainer.train)
    results["grpo"] = grpo_history(trainer)
    results["after_grpo"] = timed("eval_grpo", lambda: rate(trainer.model))
    log(f"success after GRPO: {results['after_grpo']:.3f} (GRPO {times['grpo']} s, eval {times['eval_grpo']} s)")
    log(f"GRPO per step: {results['grpo']}")
    results["seconds"] = times
    return results


def main() -> None:
    from posttrain.models import load_causal_lm, load_tokenizer

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sft_steps", type=int, default=16)
    parser.add_argument("--grpo_steps", type=int, default=10)
    parser.add_argument("--eval_size", type=int, default=64)
    parser.add_argument("--output_dir", default="outputs/grpo_environment")
    options = parser.parse_args()
    start = time.perf_counter()
    results = run(load_causal_lm(MODEL), load_tokenizer(MODEL), sft_steps=options.sft_steps,
                  grpo_steps=options.grpo_steps, eval_size=options.eval_size, output_dir=options.output_dir)
    print(f"phase seconds: {results['seconds']}; total {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
