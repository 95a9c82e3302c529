"""SmolLM2-135M-Instruct learns to use a calculator tool for multi-digit arithmetic it cannot do in its head.

1. The model gets a ChatML template that can render tool calls (SmolLM2's own cannot).
2. A 2-step SFT warm-up on synthetic transcripts (user asks a*b or a+b with 3-4 digit numbers -> the assistant
   calls ``calculator`` -> the tool answers -> the assistant states the result), loss on the assistant turns only.
   Without it the model makes no tool call at all, so GRPO would have no signal; with a long one every sample of
   a prompt is the same episode, so GRPO has none either. Two steps make calls likely, not certain.
3. GRPO with ``tools=[calculator]`` and an exact-match reward on the final answer.

Held-out accuracy and tool-call rate (greedy, with the tool available) are printed before training, after the
warm-up and after GRPO, and sampled at temperature 1 after the warm-up and after GRPO, with each phase's time.

    OMP_NUM_THREADS=2 python examples/grpo_tools.py
"""

from __future__ import annotations

import argparse
import random
import re
import time

import torch
from datasets import Dataset

from posttrain import GRPOConfig, GRPOTrainer, SFTConfig, SFTTrainer
from posttrain.generation import SamplingParams, TransformersBackend, stop_token_ids
from posttrain.online.episodes import ToolRollouts
from posttrain.tools import EnvironmentPool, tool_schemas, use_chatml_tool_template

MODEL = "builtin:SmolLM2-135M-Instruct"
NUMBER = re.compile(r"-?\d+")
EXPRESSION = re.compile(r"^\s*(-?\d+)\s*([-+*])\s*(-?\d+)\s*$")


def calculator(expression: str) -> str:
    """Computes an arithmetic expression of two integers.

    Args:
        expression: Two integers joined by +, - or *, for example "1234 * 567".
    """
    match = EXPRESSION.match(expression)
    if match is None:
        raise ValueError(f"cannot compute {expression!r}: write two integers joined by +, - or *")
    a, op, b = int(match[1]), match[2], int(match[3])
    return str(a + b if op == "+" else a - b if op == "-" else a * b)


def make_problems(size: int, seed: int) -> list[dict]:
    """`size` sums and products of two 3-4 digit numbers."""
    rng = random.Random(seed)
    problems = []
    for _ in range(size):
        a, b, op = rng.randint(100, 9999), rng.randint(100, 9999), rng.choice("+*")
        problems.append({"expression": f"{a} {op} {b}", "answer": calculator(f"{a} {op} {b}")})
    return problems


def question(problem: dict) -> list[dict]:
    return [{"role": "user", "content": f"What is {problem['expression']}?"}]


def prompts(problems: list[dict]) -> Dataset:
    """GRPO's conversational prompts, with the answer as a column the reward reads."""
    return Dataset.from_list([{"prompt": question(p), "answer": p["answer"]} for p in problems])


def transcript(problem: dict) -> list[dict]:
    """The conversation the warm-up teaches: call the calculator, then state its result."""
    call = {"type": "function", "function": {"name": "calculator", "arguments": {"expression": problem["expression"]}}}
    return [
        *question(problem),
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "name": "calculator", "content": problem["answer"]},
        {"role": "assistant", "content": f"The answer is {problem['answer']}."},
    ]


def tokenized_transcripts(tokenizer, conversations: list[list[dict]], tools: list) -> Dataset:
    """Pre-tokenized SFT rows (input_ids + assistant_masks), rendered with the tools in the system turn exactly
    as GRPO will render its prompts."""
    rows = []
    for messages in conversations:
        out = tokenizer.apply_chat_template(
            messages, tools=tool_schemas(tools), tokenize=True, return_dict=True, return_assistant_tokens_mask=True
        )
        rows.append({"input_ids": list(out["input_ids"]), "assistant_masks": list(out["assistant_masks"])})
    return Dataset.from_list(rows)


def final_text(completion) -> str:
    """The last assistant message's text (a completion is a message list, or plain text)."""
    return completion[-1]["content"] if isinstance(completion, list) else completion


def exact_answer(completions, answer, **kwargs) -> list[float]:
    """1.0 when the last number of the final assistant message equals the answer."""
    rewards = []
    for completion, expected in zip(completions, answer):
        numbers = NUMBER.findall(final_text(completion).replace(",", ""))
        rewards.append(float(bool(numbers) and numbers[-1] == str(expected)))
    return rewards


def evaluate_episodes(
    model,
    tokenizer,
    rows: list[dict],
    tools: list,
    max_completion_length: int,
    max_iterations: int,
    environment_factory=None,
    batch_size: int = 50,
    temperature: float | None = None,
) -> list:
    """Tool episodes for `rows` through the same rollout code as training: greedy (top_k=1) by default, else
    sampled at `temperature` with one fixed seed per row (reproducible)."""
    sampling = (
        SamplingParams(max_tokens=max_completion_length, top_k=1)
        if temperature is None
        else SamplingParams(max_tokens=max_completion_length, temperature=temperature)
    )
    backend = TransformersBackend(model, tokenizer.pad_token_id, stop_token_ids(tokenizer, model))
    pool = EnvironmentPool(environment_factory) if environment_factory is not None else None
    rollouts = ToolRollouts(backend, tokenizer, tools, pool, max_completion_length, max_iterations)
    episodes = []
    for start in range(0, len(rows), batch_size):
        batch = rows[start : start + batch_size]
        prompt_ids = [rollouts.render_prompt(row["prompt"], rollouts.schemas) for row in batch]
        episodes += rollouts.generate(
            batch, prompt_ids, 1, sampling, seeds=list(range(start, start + len(batch))), prompt_column="prompt"
        )
        for episode in episodes[-len(batch) :]:  # environments are reused by the next batch: read rewards now
            if "environments" in episode.reward_kwargs:
                episode.info["reward"] = float(episode.reward_kwargs.pop("environments").get_reward())
    return episodes


def evaluate(
    model, tokenizer, problems: list[dict], max_completion_length: int, temperature: float | None = None
) -> dict[str, float]:
    """Held-out accuracy (exact final answer) and tool-call rate (episodes with at least one call), greedy or
    sampled at `temperature`."""
    rows = prompts(problems).to_list()
    episodes = evaluate_episodes(
        model, tokenizer, rows, [calculator], max_completion_length, max_iterations=2, temperature=temperature
    )
    completions = [e.messages or tokenizer.decode(e.token_ids, skip_special_tokens=True) for e in episodes]
    scores = exact_answer(completions, [p["answer"] for p in problems])
    return {
        "accuracy": sum(scores) / len(scores),
        "tool_call_rate": sum(e.info["tool_calls"] > 0 for e in episodes) / len(episodes),
    }


def warm_up(model, tokenizer, dataset: Dataset, steps: int, output_dir: str, learning_rate: float, batch_size: int = 4):
    """A short assistant-only SFT run on `dataset` (pre-tokenized); returns the trained model."""
    args = SFTConfig(
        output_dir=output_dir,
        max_steps=steps,
        per_device_train_batch_size=batch_size,
        learning_rate=learning_rate,
        lr_scheduler_type="constant",
        logging_steps=max(1, steps // 5),
        save_strategy="no",
        report_to="none",
        seed=0,
        use_cpu=not torch.cuda.is_available(),
        disable_tqdm=True,
    )
    trainer = SFTTrainer(model, args=args, train_dataset=dataset, processing_class=tokenizer)
    trainer.train()
    return trainer.model


def grpo_config(output_dir: str, steps: int, **overrides) -> GRPOConfig:
    """The small-budget GRPO settings both demos share. The learning rate is higher than a long run would use:
    a handful of steps must move a policy that the short warm-up left stochastic. `log_completions` keeps every
    episode in output_dir/completions.jsonl; the run's report.html shows a few transcripts, tool calls marked."""
    settings = dict(
        output_dir=output_dir,
        max_steps=steps,
        learning_rate=3e-5,
        per_device_train_batch_size=8,
        num_generations=4,
        max_completion_length=96,
        temperature=1.0,
        beta=0.0,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        seed=0,
        use_cpu=not torch.cuda.is_available(),
        disable_tqdm=True,
        max_tool_calling_iterations=2,
        log_completions=True,
        num_completions_to_print=1,
    )
    settings.update(overrides)
    return GRPOConfig(**settings)


HISTORY_KEYS = ("reward", "reward_std", "frac_reward_zero_std", "entropy", "tools/call_frequency")


def grpo_history(trainer) -> dict[str, list[float]]:
    """Per-step GRPO metrics from the log history: is there a signal (reward_std > 0, groups with variance) and
    does the reward rise?"""
    return {key: [round(h[key], 3) for h in trainer.state.log_history if key in h] for key in HISTORY_KEYS}


def run(
    model,
    tokenizer,
    *,
    sft_size: int = 256,
    sft_steps: int = 2,
    sft_learning_rate: float = 1e-4,
    grpo_steps: int = 8,
    eval_size: int = 50,
    max_completion_length: int = 96,
    max_prompt_length: int | None = None,
    output_dir: str = "outputs/grpo_tools",
    log=print,
) -> dict:
    """The whole demo; returns the three evaluations, the GRPO metrics per step and the phase times.

    The warm-up is deliberately short: it makes tool calls likely but not certain, so that the completions of a
    prompt differ and GRPO's groups have reward variance (8 warm-up steps made every completion of a prompt the
    same episode, and GRPO learnt nothing). max_completion_length counts the call, the tool turn and the answer:
    an 8-digit product takes 83 tokens, so 80 cut off every such answer whatever the policy did. max_prompt_length
    (None: prompts kept whole) is for models whose context is shorter than the tool prompt."""
    use_chatml_tool_template(tokenizer)
    held_out = make_problems(eval_size, seed=1234)
    results, times = {}, {}

    def timed(name, fn):
        start = time.perf_counter()
        value = fn()
        times[name] = round(time.perf_counter() - start, 1)
        return value

    results["before"] = timed("eval_before", lambda: evaluate(model, tokenizer, held_out, max_completion_length))
    log(f"before:       {results['before']}  ({times['eval_before']} s)")
    warm = tokenized_transcripts(tokenizer, [transcript(p) for p in make_problems(sft_size, seed=1)], [calculator])
    model = timed("sft", lambda: warm_up(model, tokenizer, warm, sft_steps, f"{output_dir}/sft", sft_learning_rate))
    results["after_sft"] = timed("eval_sft", lambda: evaluate(model, tokenizer, held_out, max_completion_length))
    log(f"after SFT:    {results['after_sft']}  (SFT {times['sft']} s, eval {times['eval_sft']} s)")
    # Greedy decoding already answers every problem after the warm-up; what GRPO improves is how reliably the
    # policy itself (temperature 1, as GRPO samples it) calls the tool and copies its result.
    results["after_sft_sampled"] = timed(
        "eval_sft_sampled", lambda: evaluate(model, tokenizer, held_out, max_completion_length, 1.0)
    )
    log(f"after SFT, sampled at temperature 1: {results['after_sft_sampled']}")
    trainer = GRPOTrainer(
        model,
        exact_answer,
        args=grpo_config(
            f"{output_dir}/grpo",
            grpo_steps,
            max_completion_length=max_completion_length,
            max_prompt_length=max_prompt_length,
        ),
        train_dataset=prompts(make_problems(grpo_steps * 8, seed=2)),
        processing_class=tokenizer,
        tools=[calculator],
    )
    timed("grpo", trainer.train)
    results["grpo"] = grpo_history(trainer)
    results["after_grpo"] = timed(
        "eval_grpo", lambda: evaluate(trainer.model, tokenizer, held_out, max_completion_length)
    )
    log(f"after GRPO:   {results['after_grpo']}  (GRPO {times['grpo']} s, eval {times['eval_grpo']} s)")
    results["after_grpo_sampled"] = timed(
        "eval_grpo_sampled", lambda: evaluate(trainer.model, tokenizer, held_out, max_completion_length, 1.0)
    )
    log(f"after GRPO, sampled at temperature 1: {results['after_grpo_sampled']}")
    log(f"GRPO per step: {results['grpo']}")
    results["seconds"] = times
    return results


def main() -> None:
    from posttrain.models import load_causal_lm, load_tokenizer

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sft_steps", type=int, default=2)
    parser.add_argument("--grpo_steps", type=int, default=8)
    parser.add_argument("--eval_size", type=int, default=50)
    parser.add_argument("--max_completion_length", type=int, default=96)
    parser.add_argument("--output_dir", default="outputs/grpo_tools")
    options = parser.parse_args()
    start = time.perf_counter()
    results = run(
        load_causal_lm(MODEL),
        load_tokenizer(MODEL),
        sft_steps=options.sft_steps,
        grpo_steps=options.grpo_steps,
        eval_size=options.eval_size,
        max_completion_length=options.max_completion_length,
        output_dir=options.output_dir,
    )
    print(f"phase seconds: {results['seconds']}; total {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
