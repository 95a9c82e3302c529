"""The tool-calling demos (examples/grpo_tools.py, examples/grpo_environment.py): their pieces, and the whole
pipelines on the tiny model (2 steps each) so that the examples cannot rot; the full runs on SmolLM2 are slow."""

from __future__ import annotations

import random
import sys
from pathlib import Path

import pytest
from transformers import AutoModelForCausalLM, AutoTokenizer

from posttrain.tools import parse_tool_calls, tool_schemas, tool_suffix_ids, use_chatml_tool_template
from posttrain.training.report import write_report

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
import grpo_environment as env_demo  # noqa: E402
import grpo_tools as tools_demo  # noqa: E402


@pytest.fixture()
def tool_tokenizer(tiny_model_path):
    return use_chatml_tool_template(AutoTokenizer.from_pretrained(tiny_model_path))


def test_calculator_and_problems():
    rng = random.Random(0)
    for _ in range(50):
        a, b, op = rng.randint(-9999, 9999), rng.randint(0, 9999), rng.choice("+-*")
        assert tools_demo.calculator(f"{a} {op} {b}") == str({"+": a + b, "-": a - b, "*": a * b}[op])
    with pytest.raises(ValueError, match="two integers"):
        tools_demo.calculator("2 ** 10")
    problems = tools_demo.make_problems(200, seed=3)
    assert problems == tools_demo.make_problems(200, seed=3) != tools_demo.make_problems(200, seed=4)
    for p in problems:
        a, op, b = p["expression"].split()
        assert 100 <= int(a) <= 9999 and 100 <= int(b) <= 9999 and op in "+*"
    assert {p["expression"].split()[1] for p in problems} == {"+", "*"}


def test_exact_answer_reward_reads_the_final_message():
    conversation = [
        {"role": "assistant", "content": "", "tool_calls": []},
        {"role": "tool", "content": "42"},
        {"role": "assistant", "content": "The answer is 1,042."},
    ]
    assert tools_demo.exact_answer(
        [conversation, conversation, "it is 42", "no number"], ["1042", "42", "42", "42"]
    ) == [1.0, 0.0, 1.0, 0.0]


def test_warm_up_transcripts_have_the_rollout_token_layout(tool_tokenizer):
    """A warm-up transcript's ids are exactly what a GRPO tool episode would hold: prompt (with the tools) + the
    call turn + the tool turn as `tool_suffix_ids` renders it + the answer turn; only the two model turns are
    trained on, and the call they teach is one the hermes parser reads back."""
    problem = tools_demo.make_problems(1, seed=0)[0]
    messages = tools_demo.transcript(problem)
    row = tools_demo.tokenized_transcripts(tool_tokenizer, [messages], [tools_demo.calculator])[0]
    ids, mask = row["input_ids"], row["assistant_masks"]
    schemas = tool_schemas([tools_demo.calculator])
    prompt = tool_tokenizer.apply_chat_template(messages[:1], tools=schemas, add_generation_prompt=True, tokenize=False)
    prompt_ids = tool_tokenizer(prompt, add_special_tokens=False)["input_ids"]
    suffix = tool_suffix_ids(tool_tokenizer, [messages[2]], tools=schemas)
    assert ids[: len(prompt_ids)] == prompt_ids and not any(mask[: len(prompt_ids)])
    call_end = ids.index(tool_tokenizer.eos_token_id, len(prompt_ids)) + 1
    call_ids = ids[len(prompt_ids) : call_end]
    assert ids[call_end : call_end + len(suffix)] == suffix and not any(mask[call_end : call_end + len(suffix)])
    assert all(mask[len(prompt_ids) : call_end])
    turn = parse_tool_calls(
        tool_tokenizer.decode(call_ids, skip_special_tokens=True), "hermes", tools=[tools_demo.calculator]
    )
    assert [(c.name, c.arguments) for c in turn.calls] == [("calculator", {"expression": problem["expression"]})]
    answer = tool_tokenizer.decode(
        [t for t, m in zip(ids[call_end + len(suffix) :], mask[call_end + len(suffix) :]) if m],
        skip_special_tokens=True,
    )
    assert answer.strip() == f"The answer is {problem['answer']}."


def test_guess_the_number_environment_and_transcripts():
    game = env_demo.GuessTheNumber()
    game.reset(secret=5)
    assert [game.guess(n) for n in (2, 7, 5)] == ["higher", "lower", "correct"] and game.get_reward() == 1.0
    game.reset(secret=3)
    assert game.get_reward() == 0.0
    game.reset(secret=5)  # 2 -> higher, 7 -> lower: 3..6 left, 4 of the 7 wrong numbers ruled out
    assert [game.guess(n) for n in (2, 7)] == ["higher", "lower"] and game.get_reward() == 0.5 * 4 / 7
    game.reset(secret=8)  # 7 -> higher: only 8 left, every wrong number ruled out, yet not found
    assert game.guess(7) == "higher" and game.get_reward() == 0.5
    rng = random.Random(0)
    outcomes = []
    for _ in range(100):
        secret = rng.randint(env_demo.LOW, env_demo.HIGH)
        messages = env_demo.transcript(secret, rng, max_guesses=3)
        game.reset(secret=secret)
        calls = [m["tool_calls"][0]["function"]["arguments"]["number"] for m in messages if m.get("tool_calls")]
        feedback = [m["content"] for m in messages if m["role"] == "tool"]
        assert [game.guess(n) for n in calls] == feedback  # the transcripts tell the truth
        assert len(set(calls)) == len(calls) <= 3  # never a guess the feedback already ruled out
        outcomes.append(game.get_reward() == 1.0)
        assert messages[-1]["content"].startswith("Found it") == (game.get_reward() == 1.0)
    assert 0.3 < sum(outcomes) / len(outcomes) < 1.0  # random in-range guessing: room for GRPO to improve
    # the weaker warm-up's games ignore the feedback: guesses anywhere in the range, repeats included
    rng = random.Random(0)
    inconsistent = 0
    for _ in range(200):
        secret = rng.randint(env_demo.LOW, env_demo.HIGH)
        messages = env_demo.transcript(secret, rng, max_guesses=3, consistent=False)
        game.reset(secret=secret)
        calls = [m["tool_calls"][0]["function"]["arguments"]["number"] for m in messages if m.get("tool_calls")]
        assert [game.guess(n) for n in calls] == [m["content"] for m in messages if m["role"] == "tool"]
        assert all(env_demo.LOW <= n <= env_demo.HIGH for n in calls)
        low, high = env_demo.LOW, env_demo.HIGH
        for n in calls:
            inconsistent += not low <= n <= high
            low, high = (max(low, n + 1), high) if n < secret else (low, min(high, n - 1))
    assert inconsistent > 50


def test_held_out_games_are_balanced_and_the_same_for_every_model():
    rows = env_demo.held_out_games(24).to_list()
    assert [r["secret"] for r in rows] == [1, 2, 3, 4, 5, 6, 7, 8] * 3
    assert rows == env_demo.held_out_games(24).to_list()
    assert all(r["prompt"] == [{"role": "user", "content": env_demo.INSTRUCTION}] for r in rows)


def test_paired_gain_by_hand():
    # differences 1, 0, 0, 0.5: mean 0.375; squared deviations 0.390625 + 2 * 0.140625 + 0.015625 = 0.6875,
    # sample variance 0.6875 / 3, standard error sqrt(0.6875 / 3 / 4) = 0.239357...
    gain, se = env_demo.paired_gain([0.0, 0.5, 1.0, 0.25], [1.0, 0.5, 1.0, 0.75])
    assert gain == pytest.approx(0.375) and se == pytest.approx(0.2393568, abs=1e-6)
    assert env_demo.paired_gain([0.2, 0.7], [0.2, 0.7]) == (0.0, 0.0)  # the same rewards: no gain, no noise
    with pytest.raises(ValueError):
        env_demo.paired_gain([0.0, 1.0], [1.0])  # games must be paired


def test_compact_tool_template_keeps_the_rollout_token_layout(tool_tokenizer):
    """The environment demo's short system turn lists the tool in one line; a warm-up game's ids are the prompt
    the rollouts render + each call turn + each tool turn as `tool_suffix_ids` renders it (what a GRPO episode
    holds), only the model's turns are trained on, and each call is one the hermes parser reads back."""
    tokenizer = env_demo.use_compact_tool_template(tool_tokenizer)
    game = env_demo.GuessTheNumber()
    schemas = tool_schemas([game.guess])
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": env_demo.INSTRUCTION}], tools=schemas, add_generation_prompt=True, tokenize=False
    )
    assert prompt == (
        "<|im_start|>system\nTools:\nguess(number): Guess the secret number.<|im_end|>\n"
        f"<|im_start|>user\n{env_demo.INSTRUCTION}<|im_end|>\n<|im_start|>assistant\n"
    )
    messages = env_demo.transcript(6, random.Random(3), max_guesses=3)
    row = env_demo.tokenized_transcripts(tokenizer, [messages], [game.guess])[0]
    ids, mask = row["input_ids"], row["assistant_masks"]
    position = len(tokenizer(prompt, add_special_tokens=False)["input_ids"])
    assert ids[:position] == tokenizer(prompt, add_special_tokens=False)["input_ids"] and not any(mask[:position])
    calls = [m for m in messages if m.get("tool_calls")]
    assert len(calls) == 2  # 4 -> higher, 6 -> correct: two rounds of call and tool turn
    for call, answer in zip(calls, [m for m in messages if m["role"] == "tool"]):
        end = ids.index(tokenizer.eos_token_id, position) + 1
        assert all(mask[position:end])
        turn = parse_tool_calls(
            tokenizer.decode(ids[position:end], skip_special_tokens=True), "hermes", tools=[game.guess]
        )
        expected = call["tool_calls"][0]["function"]["arguments"]
        assert [(c.name, c.arguments) for c in turn.calls] == [("guess", expected)]
        suffix = tool_suffix_ids(tokenizer, [answer], tools=schemas)
        assert ids[end : end + len(suffix)] == suffix and not any(mask[end : end + len(suffix)])
        position = end + len(suffix)
    assert (
        tokenizer.decode([t for t, m in zip(ids[position:], mask[position:]) if m], skip_special_tokens=True).strip()
        == messages[-1]["content"]
    )


def test_tools_demo_runs_end_to_end_on_the_tiny_model(tiny_model_path, tool_tokenizer, tmp_path):
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path)
    results = tools_demo.run(
        model,
        tool_tokenizer,
        sft_size=8,
        sft_steps=2,
        grpo_steps=2,
        eval_size=4,
        max_completion_length=24,
        max_prompt_length=480,  # the tool prompt is 651 tokens; the tiny model's context is 512
        output_dir=str(tmp_path),
        log=lambda *a: None,
    )
    for phase in ("before", "after_sft", "after_grpo", "after_sft_sampled", "after_grpo_sampled"):
        assert set(results[phase]) == {"accuracy", "tool_call_rate"}
        assert all(0.0 <= v <= 1.0 for v in results[phase].values())
    assert set(results["grpo"]) == set(tools_demo.HISTORY_KEYS)
    assert all(len(values) == 2 for values in results["grpo"].values())
    assert set(results["seconds"]) == {
        "eval_before",
        "sft",
        "eval_sft",
        "eval_sft_sampled",
        "grpo",
        "eval_grpo",
        "eval_grpo_sampled",
    }
    # Every episode is logged for the run report, which shows tool transcripts (the suite skips writing it).
    logged = (tmp_path / "grpo" / "completions.jsonl").read_text().splitlines()
    assert len(logged) == 2 * 8 and "Sample completions" in write_report(tmp_path / "grpo").read_text()


def test_environment_demo_runs_end_to_end_on_the_tiny_model(tiny_model_path, tool_tokenizer, tmp_path):
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path)
    results = env_demo.run(
        model,
        tool_tokenizer,
        sft_size=8,
        sft_steps=2,
        grpo_steps=2,
        before_size=2,
        eval_size=4,
        max_completion_length=24,
        episodes_per_step=8,
        output_dir=str(tmp_path),
        log=lambda *a: None,
    )
    for phase, size in (("before", 2), ("after_sft", 4), ("after_grpo", 4)):
        assert 0.0 <= results[phase] <= results[f"{phase}_reward"] <= 1.0  # a win scores 1, a loss at most 0.5
        assert len(results[f"{phase}_rewards"]) == size
    assert (results["gain"], results["gain_se"]) == env_demo.paired_gain(
        results["after_sft_rewards"], results["after_grpo_rewards"]
    )
    assert set(results["grpo"]) == set(env_demo.HISTORY) and all(len(v) == 2 for v in results["grpo"].values())


def test_default_budget_fits_every_answer(smollm2_path):
    """With SmolLM2's tokenizer, the call, the tool turn and the answer of the longest result (an 8-digit product)
    fit in the demo's max_completion_length; 80, the old default, cut off every 7-8 digit answer whatever the
    policy did."""
    import inspect

    from posttrain.models import load_tokenizer

    tool_tokenizer = use_chatml_tool_template(load_tokenizer(smollm2_path))
    budget = inspect.signature(tools_demo.run).parameters["max_completion_length"].default
    problem = {"expression": "9999 * 9999", "answer": tools_demo.calculator("9999 * 9999")}
    row = tools_demo.tokenized_transcripts(tool_tokenizer, [tools_demo.transcript(problem)], [tools_demo.calculator])[0]
    ids, mask = row["input_ids"], row["assistant_masks"]
    last_eos = len(ids) - ids[::-1].index(tool_tokenizer.eos_token_id)
    assert last_eos - mask.index(1) <= budget


def test_environment_budget_fits_three_calls_not_the_third_answer(smollm2_path):
    """With SmolLM2's tokenizer a lost game's three calls and the two answers between them fit in the environment
    demo's max_completion_length, so the third guess always counts; the third answer does not fit, so the rollout
    ends there instead of sampling a closing turn that the reward never reads. A won game's closing turn fits."""
    import inspect

    from posttrain.models import load_tokenizer

    tokenizer = env_demo.use_compact_tool_template(load_tokenizer(smollm2_path))
    budget = inspect.signature(env_demo.run).parameters["max_completion_length"].default
    guess = env_demo.GuessTheNumber().guess

    def model_turn_ends(messages):  # completion tokens up to the end of each model turn, as a rollout counts them
        row = env_demo.tokenized_transcripts(tokenizer, [messages], [guess])[0]
        mask, prompt_length = row["assistant_masks"], row["assistant_masks"].index(1)
        return [i + 1 - prompt_length for i in range(len(mask) - 1) if mask[i] and not mask[i + 1]]

    lost = env_demo.transcript(8, random.Random(2), max_guesses=3)
    assert len(model_turn_ends(lost)) == 4 and lost[-1]["content"] == "I ran out of guesses."
    third_call_end = model_turn_ends(lost)[2]
    third_answer = tool_suffix_ids(tokenizer, [lost[6]], tools=tool_schemas([guess]))
    assert third_call_end <= budget <= third_call_end + len(third_answer)  # the rollout ends when >= budget
    won = env_demo.transcript(8, random.Random(0), max_guesses=3)  # found with the second guess
    assert won[-1]["content"] == "Found it: 8." and len(model_turn_ends(won)) == 3
    assert model_turn_ends(won)[-1] <= budget


@pytest.mark.slow
def test_tools_demo_on_smollm2(smollm2_path, tmp_path):
    """A reduced demo (24 held-out problems, 2 warm-up steps, 4 GRPO steps): no call before; the short warm-up
    makes calls likely without making the samples of a prompt identical, so GRPO sees groups with variance."""
    from posttrain.models import load_causal_lm, load_tokenizer

    results = tools_demo.run(
        load_causal_lm(smollm2_path),
        load_tokenizer(smollm2_path),
        grpo_steps=4,
        eval_size=24,
        output_dir=str(tmp_path),
        log=lambda *a: None,
    )
    assert results["before"]["tool_call_rate"] < 0.1
    assert results["after_sft"]["tool_call_rate"] > 0.5
    assert min(results["grpo"]["frac_reward_zero_std"]) < 1.0
    assert results["after_grpo"]["accuracy"] > results["before"]["accuracy"] + 0.3
    # The run report shows episodes that called the calculator, the call and its result marked.
    page = write_report(tmp_path / "grpo").read_text()
    assert '<span class="call">[tool call: calculator] {&quot;' in page
    assert '<span class="result">[tool result: calculator] ' in page


@pytest.mark.slow
def test_environment_demo_on_smollm2(smollm2_path, tmp_path):
    """A reduced demo (4 GRPO steps, 16 held-out games): no call before training, games played after it."""
    from posttrain.models import load_causal_lm, load_tokenizer

    results = env_demo.run(
        load_causal_lm(smollm2_path),
        load_tokenizer(smollm2_path),
        grpo_steps=4,
        eval_size=16,
        output_dir=str(tmp_path),
        log=lambda *a: None,
    )
    assert results["before_reward"] == 0.0
    assert results["after_grpo_reward"] > 0.2 and max(results["grpo"]["tools/call_frequency"]) > 1.0
