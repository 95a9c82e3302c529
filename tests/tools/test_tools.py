"""posttrain.tools: schemas, the template check, the ChatML tool template, parsers, executor, environments."""

import asyncio
import json
import time
from typing import Optional

import pytest

from posttrain.data import chat_templates as ctu
from posttrain.data.response_templates import HERMES_RESPONSE_TEMPLATE
from posttrain.errors import ConfigError, DataError
from posttrain.models.builtin import SMOLLM2_CHAT_TEMPLATE
from posttrain.tools import (
    CHATML_TOOL_TEMPLATE,
    EnvironmentPool,
    ParsedTurn,
    ParseError,
    ToolCall,
    ToolExecutor,
    ToolStats,
    chatml_tool_template,
    check_template_renders_tools,
    parse_tool_calls,
    prompt_with_observation,
    register_parser,
    result_text,
    tool_schema,
    use_chatml_tool_template,
)
from posttrain.tools.executor import TRUNCATION_MARKER


def add(a: int, b: int) -> int:
    """Adds two integers.

    Args:
        a: The first integer.
        b: The second integer.
    """
    return a + b


def scale(x: float, unit: str | None = None) -> str:
    """Scales a number.

    Args:
        x: The number.
        unit: An optional unit.
    """
    return f"{2 * x}{unit or ''}"


# -- schema ------------------------------------------------------------------------------------------------------


def test_schema_comes_from_the_signature_and_docstring():
    schema = tool_schema(add)["function"]
    assert schema["name"] == "add" and schema["description"] == "Adds two integers."
    assert schema["parameters"]["properties"]["a"] == {"type": "integer", "description": "The first integer."}
    assert schema["parameters"]["required"] == ["a", "b"]


def no_doc(a: int) -> int:
    return a


def no_hint(a) -> int:
    """Does.

    Args:
        a: A.
    """


def undocumented_arg(a: int, b: int) -> int:
    """Does.

    Args:
        a: A.
    """


@pytest.mark.parametrize(
    "tool, words", [(no_doc, "no docstring"), (no_hint, "missing a type hint"), (undocumented_arg, "'b'")]
)
def test_schema_errors_name_the_function_and_the_fix(tool, words):
    with pytest.raises(ConfigError, match=tool.__name__) as error:
        tool_schema(tool)
    assert words in str(error.value) and "Args:" in str(error.value)


def test_schema_refuses_callables_templates_cannot_describe():
    import functools

    with pytest.raises(ConfigError, match="not a function or a bound method"):
        tool_schema(functools.partial(add, 1))


# -- template check and the ChatML tool template ------------------------------------------------------------------


@pytest.fixture()
def chatml():
    """A fresh ChatML tokenizer with SmolLM2's special tokens (<|im_start|>, <|im_end|>)."""
    from posttrain.models.tiny import build_tiny_tokenizer

    return build_tiny_tokenizer()


def test_template_check_refuses_smollm2_template(chatml):
    chatml.chat_template = SMOLLM2_CHAT_TEMPLATE
    with pytest.raises(ConfigError) as error:
        check_template_renders_tools(chatml, [add])
    message = str(error.value)
    assert "tool list" in message and "tool call" in message and "chat_template_path" in message
    assert ctu.supports_tool_calling(chatml) is False  # the TRL-named helper agrees


def test_template_check_refuses_a_template_that_fails_on_tools(chatml):
    chatml.chat_template = (
        "{% for m in messages %}{% if m['role'] == 'tool' %}{{ raise_exception('no tools') }}"
        "{% endif %}{{ m['content'] }}{% endfor %}"
    )
    with pytest.raises(ConfigError, match="cannot render a tool-calling conversation"):
        check_template_renders_tools(chatml, [add])
    chatml.chat_template = None
    with pytest.raises(ConfigError, match="no chat template"):
        check_template_renders_tools(chatml, [add])


def test_template_check_accepts_the_chatml_tool_template(chatml):
    chatml.chat_template = SMOLLM2_CHAT_TEMPLATE
    check_template_renders_tools(chatml, [add, scale], chat_template=CHATML_TOOL_TEMPLATE)
    use_chatml_tool_template(chatml)
    check_template_renders_tools(chatml, [add, scale])


def test_chatml_tool_template_renders_like_smollm2_without_tools(chatml):
    chatml.chat_template = CHATML_TOOL_TEMPLATE
    conversations = [
        [{"role": "user", "content": "Hi"}],
        [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello."},
            {"role": "user", "content": "Bye"},
        ],
    ]
    for messages in conversations:
        for generation_prompt in (True, False):
            assert chatml.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=generation_prompt
            ) == chatml.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=generation_prompt, chat_template=SMOLLM2_CHAT_TEMPLATE
            )


def test_chatml_tool_template_round_trips_through_the_parser_and_trl_helpers(chatml):
    use_chatml_tool_template(chatml)
    assert chatml.response_template is HERMES_RESPONSE_TEMPLATE
    assert ctu.supports_tool_calling(chatml) and ctu.is_chat_template_prefix_preserving(chatml)
    assert ctu.get_training_chat_template(chatml) is None  # already has {% generation %} and preserves prefixes
    calls = [
        {"type": "function", "function": {"name": "add", "arguments": {"a": 2, "b": 3}}},
        {"type": "function", "function": {"name": "scale", "arguments": {"x": 1.5}}},
    ]
    messages = [
        {"role": "user", "content": "2+3?"},
        {"role": "assistant", "content": "Let me see.", "tool_calls": calls},
        {"role": "tool", "name": "add", "content": "5"},
        {"role": "tool", "name": "scale", "content": "3.0"},
        {"role": "assistant", "content": "5"},
    ]
    text = chatml.apply_chat_template(messages, tools=[add, scale], tokenize=False)
    assert '"name": "add"' in text.split("<|im_start|>user")[0]  # the tool list is in the system turn
    turn = text.split("<|im_start|>assistant\n")[1].split("<|im_end|>")[0]
    parsed = parse_tool_calls(turn, tools=[add, scale])
    assert parsed.content == "Let me see."
    assert [(c.name, c.arguments) for c in parsed.calls] == [("add", {"a": 2, "b": 3}), ("scale", {"x": 1.5})]
    assert text.count("<tool_response>") == 2 and text.count("<|im_start|>user") == 2  # results share one turn
    # transformers' own parser, set by add_response_schema, reads the same turn the same way
    ids = chatml(turn + "<|im_end|>")["input_ids"]
    assert chatml.parse_response(ids, prefix="")["tool_calls"] == calls
    # assistant-only masks cover the model's turns (calls included) and nothing else
    out = chatml.apply_chat_template(messages, tools=[add, scale], return_dict=True, return_assistant_tokens_mask=True)
    trained = chatml.decode([i for i, m in zip(out["input_ids"], out["assistant_masks"]) if m])
    assert trained == turn + "<|im_end|>" + "5<|im_end|>"


def test_chatml_tool_template_default_system_is_configurable(chatml):
    text = chatml.apply_chat_template(
        [{"role": "user", "content": "x"}], tokenize=False, chat_template=chatml_tool_template(None)
    )
    assert text == "<|im_start|>user\nx<|im_end|>\n"


# -- parsers -----------------------------------------------------------------------------------------------------


def test_hermes_parses_several_calls_and_the_text_around_them():
    text = (
        'First. <tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>\n'
        '<tool_call>{"name": "scale", "arguments": "{\\"x\\": 3}"}</tool_call> done'
    )
    parsed = parse_tool_calls(text)
    assert [(c.name, c.arguments) for c in parsed.calls] == [("add", {"a": 1, "b": 2}), ("scale", {"x": 3})]
    assert parsed.calls[0].raw == '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'
    assert parsed.content == "First. \n done" and parsed.errors == []


def test_hermes_reports_invalid_partial_and_nameless_calls_as_errors():
    text = (
        '<tool_call>{"name": "add", "arguments": {"a": 1,}}</tool_call>'
        '<tool_call>{"arguments": {}}</tool_call>'
        '<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>'
        '<tool_call>{"name": "add", "argu'
    )
    parsed = parse_tool_calls(text)
    kinds = [a.kind if isinstance(a, ParseError) else a.name for a in parsed.attempts]
    assert kinds == ["invalid_json", "bad_format", "add", "partial"]
    assert parsed.attempts[3].raw == '<tool_call>{"name": "add", "argu'


def test_plain_text_has_no_calls():
    assert parse_tool_calls("The answer is 5.") == ParsedTurn("The answer is 5.", [])
    assert not parse_tool_calls("The answer is 5.", parser="llama3").has_calls


def test_unknown_tools_are_errors_and_string_arguments_are_cast_with_the_schemas():
    text = (
        '<tool_call>{"name": "add", "arguments": {"a": "2", "b": "3.0"}}</tool_call>'
        '<tool_call>{"name": "scale", "arguments": {"x": "1.5", "unit": "7"}}</tool_call>'
        '<tool_call>{"name": "mul", "arguments": {}}</tool_call>'
    )
    parsed = parse_tool_calls(text, tools=[add, scale])
    a, s, unknown = parsed.attempts
    assert a.arguments == {"a": 2, "b": 3} and type(a.arguments["b"]) is int
    assert s.arguments == {"x": 1.5, "unit": "7"}  # a string parameter stays a string
    assert unknown.kind == "unknown_tool" and unknown.name == "mul" and "'add'" in unknown.message


def test_llama3_json_calls_with_and_without_python_tag():
    parsed = parse_tool_calls(
        '<|python_tag|>{"name": "add", "parameters": {"a": 1, "b": 2}}; {"name": "scale", "arguments": {"x": 2}}',
        parser="llama3",
    )
    assert [(c.name, c.arguments) for c in parsed.calls] == [("add", {"a": 1, "b": 2}), ("scale", {"x": 2})]
    assert parsed.content == ""
    parsed = parse_tool_calls('Sure. {"name": "add", "parameters": {"a": 1, "b"', parser="llama3")
    assert parsed.content == "Sure." and [e.kind for e in parsed.errors] == ["partial"]
    parsed = parse_tool_calls(
        '{"name": "add", "parameters": {"a": 1,, "b": 2}} {"name": "add", "parameters": {}}', parser="llama3"
    )
    assert [type(a).__name__ for a in parsed.attempts] == ["ParseError", "ToolCall"]
    assert parsed.attempts[0].kind == "invalid_json"


def test_pluggable_parsers_by_callable_and_by_registered_name():
    def bracket(text):  # [name a=1 b=2]
        name, *pairs = text.strip("[]").split()
        return [{"name": name, "arguments": {k: v for k, v in (p.split("=") for p in pairs)}}]

    parsed = parse_tool_calls("[add a=1 b=2]", parser=bracket, tools=[add])
    assert parsed.calls == [
        ToolCall("add", {"a": 1, "b": 2}, json.dumps({"name": "add", "arguments": {"a": "1", "b": "2"}}))
    ]
    register_parser("bracket", bracket)
    assert parse_tool_calls("[add a=1 b=2]", parser="bracket").calls[0].arguments == {"a": "1", "b": "2"}
    failing = parse_tool_calls("no brackets", parser=lambda text: 1 / 0)
    assert [e.kind for e in failing.errors] == ["parser_error"] and "ZeroDivisionError" in failing.errors[0].message
    with pytest.raises(ConfigError, match="Unknown tool-call parser 'nope'"):
        parse_tool_calls("x", parser="nope")


# -- executor ----------------------------------------------------------------------------------------------------


def boom(x: int) -> int:
    """Raises.

    Args:
        x: Anything.
    """
    raise RuntimeError(f"bad input {x}")


def slow(seconds: float) -> str:
    """Sleeps.

    Args:
        seconds: How long.
    """
    time.sleep(seconds)
    return "woke"


async def aslow(seconds: float) -> str:
    """Sleeps asynchronously.

    Args:
        seconds: How long.
    """
    await asyncio.sleep(seconds)
    return "woke"


async def aboom(x: int) -> int:
    """Raises asynchronously.

    Args:
        x: Anything.
    """
    raise ValueError("async failure")


def structured(kind: str) -> object:
    """Returns structures.

    Args:
        kind: Which one.
    """
    return {"dict": {"b": [1, 2], "a": "é"}, "list": [1, "x"], "set": {3}, "none": None, "long": "x" * 50}[kind]


def run(executor, text):
    return executor.run(parse_tool_calls(text, tools=list(executor.tools.values())))


def call(name, **arguments):
    return f"<tool_call>{json.dumps({'name': name, 'arguments': arguments})}</tool_call>"


def test_a_tool_that_raises_becomes_an_error_message():
    [result] = run(ToolExecutor([boom]), call("boom", x=3))
    assert result.status == "failed" and result.failed
    assert json.loads(result.content) == {"error": "RuntimeError: bad input 3"}
    assert result.message == {"role": "tool", "name": "boom", "content": result.content}


@pytest.mark.parametrize("tool", [slow, aslow])
def test_timeouts_return_control_and_tell_the_model(tool):
    executor = ToolExecutor([tool], timeout=0.2)
    started = time.perf_counter()
    [late, quick] = run(executor, call(tool.__name__, seconds=5) + call(tool.__name__, seconds=0))
    assert time.perf_counter() - started < 2.0
    assert late.status == "timed_out" and "0.2 s" in late.content and 0.19 < late.seconds < 2.0
    assert quick.status == "ok" and quick.content == "woke"


def test_async_tools_run_concurrently_and_keep_the_call_order():
    executor = ToolExecutor([aslow, aboom, add], timeout=5)
    started = time.perf_counter()
    results = run(
        executor, call("aslow", seconds=0.3) + call("add", a=1, b=2) + call("aboom", x=1) + call("aslow", seconds=0.3)
    )
    assert time.perf_counter() - started < 0.55  # the two 0.3 s sleeps overlap
    assert [(r.name, r.status, r.content) for r in results] == [
        ("aslow", "ok", "woke"),
        ("add", "ok", "3"),
        ("aboom", "failed", '{"error": "ValueError: async failure"}'),
        ("aslow", "ok", "woke"),
    ]


def test_non_text_results_become_text_and_long_ones_are_cut():
    executor = ToolExecutor([structured], max_result_chars=10)
    contents = [
        r.content
        for r in run(executor, "".join(call("structured", kind=k) for k in ("dict", "list", "set", "none", "long")))
    ]
    assert contents[1:4] == ['[1, "x"]', "{3}", "None"]  # JSON for lists / dicts, repr otherwise
    assert contents[0] == '{"b": [1, ' + TRUNCATION_MARKER.format(n=len('{"b": [1, 2], "a": "é"}') - 10)
    assert contents[4] == "x" * 10 + TRUNCATION_MARKER.format(n=40)
    assert result_text({"a": "é"}) == '{"a": "é"}'
    blocks = [{"type": "text", "text": "see"}, {"type": "image", "image": "img"}]
    assert result_text(blocks) is blocks  # multimodal content blocks pass through, as in TRL


@pytest.mark.parametrize(
    "arguments, problem",
    [
        ({"a": 1}, "missing a required argument: 'b'"),
        ({"a": 1, "b": 2, "c": 3}, "unexpected keyword argument 'c'"),
        ({"a": "one", "b": 2}, "'a' must be integer"),
        ({"a": True, "b": 2}, "'a' must be integer"),
        ({"a": 1.5, "b": 2}, "'a' must be integer"),
    ],
)
def test_bad_arguments_are_refused_before_the_call(arguments, problem):
    calls = []

    def add(a: int, b: int) -> int:
        """Adds.

        Args:
            a: A.
            b: B.
        """
        calls.append((a, b))
        return a + b

    [result] = ToolExecutor([add]).run([ToolCall("add", arguments)])
    assert result.status == "failed" and problem in json.loads(result.content)["error"]
    assert calls == []


def test_optional_and_enum_arguments_are_checked_against_the_schema():
    from typing import Literal

    def pick(color: Literal["red", "blue"], weight: float | None = None) -> str:
        """Picks.

        Args:
            color: The color.
            weight: The weight.
        """
        return color

    executor = ToolExecutor([pick])
    statuses = [
        r.status
        for r in executor.run(
            [
                ToolCall("pick", {"color": "red", "weight": None}),
                ToolCall("pick", {"color": "red", "weight": 2}),
                ToolCall("pick", {"color": "green"}),
            ]
        )
    ]
    assert statuses == ["ok", "ok", "failed"]


def test_unknown_tools_and_unreadable_calls_become_messages_and_trl_counts():
    executor = ToolExecutor([add, boom])
    turn = parse_tool_calls(
        call("add", a=1, b=2) + call("mul", a=1) + call("boom", x=0) + "<tool_call>{oops}</tool_call>",
        tools=[add, boom],
    )
    results = executor.run(turn)
    assert [r.status for r in results] == ["ok", "failed", "failed", "parse_error"]
    assert "no tool named 'mul'" in results[1].content and "not valid JSON" in results[3].content
    # a call the parser did not check is refused by the executor all the same
    [unchecked] = executor.run([ToolCall("mul", {})])
    assert unchecked.status == "failed" and "no tool named 'mul'" in unchecked.content
    stats = ToolStats.of(results) + ToolStats.of([unchecked])
    assert (stats.calls, stats.failures, stats.parse_errors) == (4, 3, 1)
    # TRL: calls / rollouts, failures / calls (0 without calls)
    assert stats.metrics(num_rollouts=8) == {
        "tools/call_frequency": 0.5,
        "tools/failure_frequency": 0.75,
        "tools/parse_error_frequency": 0.125,
    }
    assert ToolStats().metrics(4)["tools/failure_frequency"] == 0.0


def test_executor_settings_are_checked():
    with pytest.raises(ConfigError, match="timeout"):
        ToolExecutor([add], timeout=0)
    with pytest.raises(ConfigError, match="both named 'add'"):
        ToolExecutor([add, add])


# -- environments ------------------------------------------------------------------------------------------------


class GuessEnv:
    """Guess-the-number: the target comes from the row; each guess gets higher / lower / correct."""

    built = 0

    def __init__(self):
        GuessEnv.built += 1
        self.target, self.guesses, self.done = None, 0, False

    def reset(self, target, **row):
        self.target, self.guesses, self.done = target, 0, False
        return " (between 1 and 100)"

    def guess(self, number: int) -> str:
        """Guesses the number.

        Args:
            number: The guess.
        """
        if self.done:
            raise ValueError("the game is over")
        self.guesses += 1
        if number == self.target:
            self.done = True
            return "correct"
        return "higher" if number < self.target else "lower"

    def get_reward(self) -> float:
        return 1.0 / self.guesses if self.done else 0.0

    def _secret(self) -> int:
        return self.target

    @property
    def exploding(self):
        raise AssertionError("properties must not be evaluated")


class EchoEnv:
    def reset(self, **row):
        return None

    async def echo(self, text: str) -> str:
        """Echoes.

        Args:
            text: What to echo.
        """
        return text


def test_environment_pool_exposes_bound_public_methods_and_isolates_rollouts():
    done_pool = EnvironmentPool(GuessEnv, done_attribute="done")  # posttrain's opt-in end-of-episode signal
    GuessEnv.built = 0
    pool = EnvironmentPool(GuessEnv, standalone_tools=[add])
    assert [s["function"]["name"] for s in pool.tool_schemas[None]] == ["add", "guess"]
    rows = [{"prompt": [{"role": "user", "content": "Guess"}], "target": t} for t in (30, 30, 70)]
    episodes = pool.start(rows)
    assert GuessEnv.built == 3 and len({id(e.environment) for e in episodes}) == 3
    assert [t.__name__ for t in episodes[0].tools] == ["add", "guess"]
    executors = [ToolExecutor(e.tools) for e in episodes]
    outcomes = [
        [r.content for r in ex.run(parse_tool_calls(call("guess", number=n), tools=e.tools))]
        for ex, e, n in zip(executors, episodes, (50, 30, 70))
    ]
    assert outcomes == [["lower"], ["correct"], ["correct"]]
    assert [pool.is_done(e) for e in episodes] == [False, False, False]  # TRL has no done signal by default
    assert [done_pool.is_done(e) for e in episodes] == [False, True, True]
    [(name, reward)] = pool.reward_functions()
    assert name == "GuessEnv" and reward(environments=[e.environment for e in episodes]) == [0.0, 1.0, 1.0]
    # an episode that is over reports it through the tool result, never a crash
    [after] = executors[1].run([ToolCall("guess", {"number": 1})])
    assert after.status == "failed" and "the game is over" in after.content
    # the next batch reuses the built instances (reset again) and only grows the pool when needed
    again = pool.start(rows[:2])
    assert GuessEnv.built == 3 and again[0].environment is episodes[0].environment
    assert again[1].environment.guesses == 0 and not again[1].environment.done


def test_reset_observation_is_appended_to_the_prompt_without_touching_the_row():
    prompt = [{"role": "system", "content": "S"}, {"role": "user", "content": "Guess"}]
    assert prompt_with_observation(prompt, " (1-100)")[-1] == {"role": "user", "content": "Guess (1-100)"}
    assert prompt[-1]["content"] == "Guess"
    assert prompt_with_observation(prompt, None) == prompt
    assert prompt_with_observation(None, "Start") == [{"role": "user", "content": "Start"}]


def test_dict_factory_selects_by_the_environment_column():
    pool = EnvironmentPool({"guess": GuessEnv, "echo": EchoEnv})
    assert [s["function"]["name"] for s in pool.tool_schemas["echo"]] == ["echo"]
    episodes = pool.start([{"environment": "echo", "prompt": "p"}, {"environment": "guess", "target": 3}])
    assert [type(e.environment).__name__ for e in episodes] == ["EchoEnv", "GuessEnv"]
    [result] = ToolExecutor(episodes[0].tools).run([ToolCall("echo", {"text": "hi"})])
    assert result.content == "hi"
    [(_, reward)] = pool.reward_functions()  # only GuessEnv owns a reward; other rollouts get None
    assert reward(environments=[e.environment for e in episodes]) == [None, 0.0]
    with pytest.raises(DataError, match="not among the environments passed to environment_factory"):
        pool.start([{"environment": "chess"}])
    with pytest.raises(DataError, match="`environment` column"):
        pool.start([{"prompt": "p"}])


def test_environment_errors_before_training():
    class NoReset:
        def act(self, x: int) -> int:
            """Acts.

            Args:
                x: X.
            """

    class BadTool:
        def reset(self, **row):
            pass

        def act(self, x):
            return x

    with pytest.raises(ConfigError, match="without a callable `reset`"):
        EnvironmentPool(NoReset)
    with pytest.raises(ConfigError, match="BadTool: public method act"):
        EnvironmentPool(BadTool)


# -- token-level: the tool turn's ids ----------------------------------------------------------------------------


def test_tool_suffix_is_exactly_what_the_template_puts_between_two_assistant_turns(chatml):
    from posttrain.tools import tool_suffix_ids

    use_chatml_tool_template(chatml)
    results = [{"role": "tool", "name": "add", "content": "5"}, {"role": "tool", "name": "add", "content": "7"}]
    suffix = tool_suffix_ids(chatml, results)
    assert chatml.decode(suffix) == (
        "\n<|im_start|>user\n<tool_response>\n5\n</tool_response>\n<tool_response>\n7\n"
        "</tool_response><|im_end|>\n<|im_start|>assistant\n"
    )
    # prompt ids + the model's ids (as sampled) + suffix == the ids of the whole conversation, token for token
    prompt = [{"role": "user", "content": "2+3 and 3+4?"}]
    calls = [
        {"type": "function", "function": {"name": "add", "arguments": {"a": a, "b": b}}} for a, b in ((2, 3), (3, 4))
    ]
    prompt_ids = chatml.apply_chat_template(prompt, tools=[add], add_generation_prompt=True, return_dict=False)
    sampled = chatml.encode(
        "\n".join(f"<tool_call>\n{json.dumps(c['function'])}\n</tool_call>" for c in calls) + "<|im_end|>"
    )
    whole = chatml.apply_chat_template(
        prompt + [{"role": "assistant", "content": "", "tool_calls": calls}] + results,
        tools=[add],
        add_generation_prompt=True,
        return_dict=False,
    )
    assert prompt_ids + sampled + suffix == whole


def test_tool_suffix_refuses_templates_that_rewrite_earlier_turns(chatml):
    from posttrain.tools import tool_suffix_ids

    chatml.chat_template = (
        "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + (m['content'] or '') }}"
        "{% if loop.last %}<|im_end|>{% else %}|{% endif %}{% endfor %}"
    )
    with pytest.raises(ConfigError, match="prefix-preserving"):
        tool_suffix_ids(chatml, [{"role": "tool", "name": "add", "content": "5"}])


# -- side by side with TRL 1.16 ----------------------------------------------------------------------------------


def test_trl_accepts_the_chatml_tool_template_and_reads_and_appends_tool_turns_the_same(chatml):
    import sys
    import types

    sys.path.insert(0, __file__.rsplit("/", 1)[0])
    from _trl import import_trl

    from posttrain.tools import tool_suffix_ids

    import_trl("grpo_trainer")
    import trl.chat_template_utils as trl_ctu
    from trl.trainer.grpo_trainer import GRPOTrainer

    chatml.chat_template = SMOLLM2_CHAT_TEMPLATE
    assert trl_ctu.supports_tool_calling(chatml) is False  # TRL refuses SmolLM2's own template too
    use_chatml_tool_template(chatml)
    assert trl_ctu.supports_tool_calling(chatml) and trl_ctu.is_chat_template_prefix_preserving(chatml)
    prompt_ids = chatml.apply_chat_template(
        [{"role": "user", "content": "2+3?"}], tools=[add, scale], add_generation_prompt=True, return_dict=False
    )
    text = "Sure.\n" + call("add", a="2", b=3) + "\n" + call("scale", x=1.5) + "<|im_end|>"
    trl_parsed = trl_ctu.parse_response(chatml, chatml.encode(text), prefix=prompt_ids, tools=[add, scale])
    ours = parse_tool_calls(text.removesuffix("<|im_end|>"), tools=[add, scale])
    assert trl_parsed["tool_calls"] == [c.as_message_call() for c in ours.calls]
    assert trl_parsed["content"] == ours.content
    # TRL's tool-turn ids (GRPOTrainer._get_tool_suffix_ids) equal posttrain's
    fake = types.SimpleNamespace(
        processing_class=chatml, _tokenizer=chatml, _is_vlm=False, chat_template=None, chat_template_kwargs={}
    )
    messages = [{"role": "tool", "name": "add", "content": "5"}, {"role": "tool", "name": "scale", "content": "3.0"}]
    assert GRPOTrainer._get_tool_suffix_ids(fake, messages) == tool_suffix_ids(chatml, messages)


@pytest.mark.slow
def test_builtin_smollm2_tokenizer_is_refused_until_given_the_chatml_tool_template(smollm2_path):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(smollm2_path)
    with pytest.raises(ConfigError, match="does not render the tool list"):
        check_template_renders_tools(tokenizer, [add])
    use_chatml_tool_template(tokenizer)
    check_template_renders_tools(tokenizer, [add])
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Hi"}], tokenize=False, add_generation_prompt=True
    )
    assert text == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
        "<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    )
