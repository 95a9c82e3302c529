"""A multi-turn game with feedback: SmolLM2-135M-Instruct learns to play guess-the-number through
``environment_factory=``.

Each rollout gets its own `GuessTheNumber` environment, reset with the dataset row's secret; its public method
``guess(number)`` is the model's tool and answers "higher", "lower" or "correct"; ``get_reward()`` gives 1.0 when
the secret was found, else partial credit for the share of wrong numbers the guesses ruled out (at most 0.5), so
that a group of games whose secrets were all missed still tells a guess that halves the range from one that does
not. A short SFT warm-up on synthetic games (guesses that respect the feedback but are otherwise random) teaches the
call format, then GRPO trains on the environment's reward. The held-out success rate and mean reward (sampled at
temperature 1, fixed seeds) are printed before, after the warm-up and after GRPO, with the reward per GRPO step.

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
        self.low, self.high = LOW, HIGH  # the numbers the feedback so far leaves possible

    def guess(self, number: int) -> str:
        """Guess the secret number.

        Args:
            number: Your guess, a whole number in the game's range.
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


def success_rate(model, tokenizer, held_out: Dataset, max_completion_length: int,
                 max_iterations: int) -> tuple[float, float]:
    """(share of held-out games won, mean reward), sampled at temperature 1 with fixed seeds: every game has the
    same prompt, so greedy decoding would play only 8 distinct games whatever eval_size is."""
    episodes = evaluate_episodes(model, tokenizer, held_out.to_list(), [], max_completion_length, max_iterations,
                                 environment_factory=GuessTheNumber, temperature=1.0)
    rewards = [e.info["reward"] for e in episodes]
    return sum(r == 1.0 for r in rewards) / len(rewards), sum(rewards) / len(rewards)


def run(model, tokenizer, *, sft_size: int = 128, sft_steps: int = 16, grpo_steps: int = 10, eval_size: int = 64,
        max_guesses: int = 3, max_completion_length: int = 160, episodes_per_step: int = 16,
        learning_rate: float = 2e-5, output_dir: str = "outputs/grpo_environment", log=print) -> dict:
    """The whole demo; returns the three success rates (and `<phase>_reward`, the mean rewards), the GRPO metrics
    per step and the phase times."""
    use_chatml_tool_template(tokenizer)
    held_out = games(eval_size, seed=1234)
    results, times = {}, {}

    def timed(name, fn):
        start = time.perf_counter()
        value = fn()
        times[name] = round(time.perf_counter() - start, 1)
        return value

    def evaluate(phase, policy, took=""):
        results[phase], results[f"{phase}_reward"] = timed(
            f"eval_{phase}", lambda: success_rate(policy, tokenizer, held_out, max_completion_length, max_guesses))
        log(f"{phase}: success {results[phase]:.3f}, mean reward {results[f'{phase}_reward']:.3f} "
            f"({took}eval {times[f'eval_{phase}']} s)")

    evaluate("before", model)
    rng = random.Random(1)
    sft_games = [transcript(rng.randint(LOW, HIGH), rng, max_guesses) for _ in range(sft_size)]
    warm = tokenized_transcripts(tokenizer, sft_games, [GuessTheNumber().guess])
    model = timed("sft", lambda: warm_up(model, tokenizer, warm, sft_steps, f"{output_dir}/sft", 1e-4))
    evaluate("after_sft", model, f"SFT {times['sft']} s, ")
    trainer = GRPOTrainer(model, None, args=grpo_config(f"{output_dir}/grpo", grpo_steps,
                                                        max_completion_length=max_completion_length,
                                                        max_tool_calling_iterations=max_guesses,
                                                        per_device_train_batch_size=episodes_per_step,
                                                        learning_rate=learning_rate),
                          train_dataset=games(grpo_steps * episodes_per_step, seed=2), processing_class=tokenizer,
                          environment_factory=GuessTheNumber)
    timed("grpo", trainer.train)
    results["grpo"] = grpo_history(trainer)
    evaluate("after_grpo", trainer.model, f"GRPO {times['grpo']} s, ")
    log(f"GRPO per step: {results['grpo']}")
    results["seconds"] = times
    return results


def main() -> None:
    from posttrain.models import load_causal_lm, load_tokenizer

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sft_steps", type=int, default=16)
    parser.add_argument("--grpo_steps", type=int, default=10)
    parser.add_argument("--eval_size", type=int, default=64)
    parser.add_argument("--episodes_per_step", type=int, default=16, help="games per GRPO step (4 per prompt)")
    parser.add_argument("--learning_rate", type=float, default=2e-5, help="GRPO's learning rate")
    parser.add_argument("--output_dir", default="outputs/grpo_environment")
    options = parser.parse_args()
    start = time.perf_counter()
    results = run(load_causal_lm(MODEL), load_tokenizer(MODEL), sft_steps=options.sft_steps,
                  grpo_steps=options.grpo_steps, eval_size=options.eval_size,
                  episodes_per_step=options.episodes_per_step, learning_rate=options.learning_rate,
                  output_dir=options.output_dir)
    print(f"phase seconds: {results['seconds']}; total {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
