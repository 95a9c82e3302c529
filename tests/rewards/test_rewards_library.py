"""The ready-made reward functions, on hand-made completions (standard and conversational)."""

import importlib.util
import json
import math
import threading
import time

import pytest

from posttrain.errors import ConfigError, DataError
from posttrain.rewards import (
    REWARD_FUNCTIONS,
    accuracy_reward,
    completion_text,
    extract_code,
    get_cosine_scaled_reward,
    get_json_schema_reward,
    get_repetition_penalty_reward,
    get_soft_overlong_punishment,
    json_reward,
    json_schema_reward,
    library,
    reasoning_accuracy_reward,
    think_format_reward,
)


def _chat(text: str) -> list[dict[str, str]]:
    return [{"role": "assistant", "content": text}]


def _in_thread(function, *args, **kwargs):
    """Call `function` from a non-main thread (where SIGALRM timeouts are unavailable) and return its result."""
    results = []
    worker = threading.Thread(target=lambda: results.append(function(*args, **kwargs)))
    worker.start()
    worker.join()
    return results[0]


# Extra protocol arguments every reward must accept and ignore.
PROTOCOL_EXTRAS = {"prompts": ["question"], "completion_ids": [[1, 2, 3]], "trainer_state": None, "unused": [0]}


def test_completion_text():
    assert completion_text("plain") == "plain"
    assert completion_text([{"role": "assistant", "content": "the answer"}]) == "the answer"
    with pytest.raises(DataError, match="last message has string content"):
        completion_text([{"role": "assistant"}])
    with pytest.raises(DataError, match="string or a list"):
        completion_text(42)


# ---- accuracy -------------------------------------------------------------------------------------------------

ACCURACY_CASES = [
    # (completion, gold, expected)
    ("42", "42", 1.0),
    ("The answer is 42", "42", 1.0),
    ("The answer is 42.", "42", 1.0),
    ("First I got 41, then corrected it to 42", "42", 1.0),  # the last number counts
    ("The answer is 42 because 40 + 2", "42", 1.0),  # "the answer is" wins over the last number
    ("41", "42", 0.0),
    ("I do not know", "42", 0.0),
    ("", "42", 0.0),
    ("So the result is $\\boxed{\\frac{1}{2}}$.", "0.5", 1.0),
    ("0.5", "\\frac{1}{2}", 1.0),  # bare LaTeX gold (no $...$) still parses
    ("$x^2 + 1$", "1 + x^2", 1.0),
    ("$x^2 + 2$", "x^2+1", 0.0),
    ("Natalia sold 72 clips.", "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\n#### 72", 1.0),  # GSM8K gold
    ("-3", "-3", 1.0),
    ("3", "-3", 0.0),
    ("the answer is 42", 42, 1.0),  # a numeric column
    ("42", "yes", None),  # no parsable gold: does not apply
    ("42", None, None),
]


@pytest.mark.parametrize("completion, gold, expected", ACCURACY_CASES)
def test_accuracy_reward(completion, gold, expected):
    assert accuracy_reward(completions=[completion], solution=[gold], **PROTOCOL_EXTRAS) == [expected]
    assert accuracy_reward(completions=[_chat(completion)], solution=[gold]) == [expected]


def test_accuracy_reward_column_errors():
    with pytest.raises(DataError, match="needs a 'solution' dataset column"):
        accuracy_reward(completions=["42"])
    with pytest.raises(DataError, match="'solution' has 1 values for 2 completions"):
        accuracy_reward(completions=["42", "43"], solution=["42"])


def test_accuracy_reward_gives_up_on_endless_comparisons_in_the_main_thread(monkeypatch):
    monkeypatch.setattr(library, "_MATH_TIMEOUT_S", 1)
    start = time.monotonic()
    # Comparing numerically would compute 10^(10^10); math-verify's SIGALRM timeout interrupts it.
    assert accuracy_reward(completions=["3"], solution=["$10^{10^{10}}$"]) == [0.0]
    assert time.monotonic() - start < 1 + 1.5


def test_accuracy_reward_in_a_thread_uses_the_worker_process(monkeypatch):
    completions = [case[0] for case in ACCURACY_CASES]
    solutions = [case[1] for case in ACCURACY_CASES]
    expected = [case[2] for case in ACCURACY_CASES]
    assert _in_thread(accuracy_reward, completions=completions, solution=solutions) == expected

    monkeypatch.setattr(library, "_MATH_TIMEOUT_S", 1)
    start = time.monotonic()
    assert _in_thread(accuracy_reward, completions=["3"], solution=["$10^{10^{10}}$"]) == [0.0]
    assert time.monotonic() - start < 1 + 1.5


def test_hung_worker_is_killed_and_replaced(monkeypatch):
    # Timeout 0 switches math-verify's own timeout off, so the worker hangs and the parent's deadline (2 s) acts.
    monkeypatch.setattr(library, "_MATH_TIMEOUT_S", 0)
    start = time.monotonic()
    assert _in_thread(accuracy_reward, completions=["3"], solution=["$10^{10^{10}}$"]) == [0.0]
    assert time.monotonic() - start < 2 + 1.5
    assert library._MATH_WORKER._process is None  # killed
    monkeypatch.setattr(library, "_MATH_TIMEOUT_S", 1)
    assert _in_thread(accuracy_reward, completions=["42", "41"], solution=["42", "42"]) == [1.0, 0.0]


# ---- reasoning accuracy and format ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "completion, gold, expected",
    [
        ("<think>6 * 7 = 42</think>The answer is 42", "42", 1.0),
        ("<think>maybe 42</think>The answer is 41", "42", 0.0),  # numbers in the reasoning do not count
        ("<think>6 * 7 = 42", "42", 0.0),  # never closed
        ("The answer is 42", "42", 0.0),  # no think tag at all
        ("<think>a</think>41</think>42", "42", 1.0),  # the text after the last closing tag
        ("<think>x</think>42", "yes", None),  # gold without an answer: does not apply, tag or not
        ("no tag 42", "yes", None),
    ],
)
def test_reasoning_accuracy_reward(completion, gold, expected):
    assert reasoning_accuracy_reward(completions=[completion], solution=[gold], **PROTOCOL_EXTRAS) == [expected]
    assert reasoning_accuracy_reward(completions=[_chat(completion)], solution=[gold]) == [expected]


def test_reasoning_accuracy_reward_custom_delimiters():
    """TRL's `reasoning_delimiters`: the answer follows the last occurrence of any of them."""
    completions = ["<R> 6 * 7 </R_END> 42", "<R> 42 </R_END> 41", "[done] 40 [end] 42", "no delimiter 42"]
    rewards = reasoning_accuracy_reward(
        completions, ["42"] * 4, reasoning_delimiters=["</R_END>", "[end]", "[done]"], **PROTOCOL_EXTRAS
    )
    assert rewards == [1.0, 0.0, 1.0, 0.0]


@pytest.mark.parametrize(
    "completion, expected",
    [
        ("<think>reasoning</think>answer", 1.0),
        ("<think>\nstep 1\nstep 2\n</think>\n\nThe answer is 4.", 1.0),
        ("  <think>r</think>answer", 1.0),  # leading whitespace is fine
        ("<think></think>answer", 1.0),  # an empty thought is still the format
        ("<think>reasoning</think>", 0.0),  # no answer
        ("<think>reasoning</think>  \n", 0.0),
        ("answer only", 0.0),
        ("Sure! <think>r</think>answer", 0.0),  # not at the start
        ("<think>a</think>b<think>c</think>d", 0.0),  # two blocks
        ("<think>a<think>b</think>c", 0.0),  # nested opening tag
        ("<think>a</think>b</think>", 0.0),  # stray closing tag in the answer
        ("<think>never closed answer", 0.0),
    ],
)
def test_think_format_reward(completion, expected):
    assert think_format_reward(completions=[completion], **PROTOCOL_EXTRAS) == [expected]
    assert think_format_reward(completions=[_chat(completion)]) == [expected]


# ---- length and repetition ------------------------------------------------------------------------------------


def test_soft_overlong_punishment_values_at_the_boundaries():
    reward = get_soft_overlong_punishment(max_completion_len=10, soft_punish_cache=4)  # penalty starts after 6
    lengths = [0, 5, 6, 7, 8, 9, 10, 11, 100]
    expected = [0.0, 0.0, 0.0, -0.25, -0.5, -0.75, -1.0, -1.0, -1.0]  # (6 - L) / 4 inside the cache
    ids = [[0] * length for length in lengths]
    assert reward(completions=["x"] * len(ids), completion_ids=ids, prompts=["p"] * len(ids)) == expected
    assert reward(ids) == expected  # TRL's call: the token ids positionally

    hard = get_soft_overlong_punishment(max_completion_len=10, soft_punish_cache=0)
    assert hard(completions=["x"] * 2, completion_ids=[[0] * 10, [0] * 11]) == [0.0, -1.0]


def test_soft_overlong_punishment_errors():
    for max_len, cache in [(10, 11), (10, -1), (0, 0)]:
        with pytest.raises(ConfigError, match="soft_punish_cache"):
            get_soft_overlong_punishment(max_len, cache)
    with pytest.raises(DataError, match="'completion_ids'"):
        get_soft_overlong_punishment(10, 4)(completions=["x"])


def test_repetition_penalty_reward_counts_token_ngrams():
    reward = get_repetition_penalty_reward(ngram_size=3, max_penalty=-1.0)
    completion_ids = [
        [1, 2, 3, 1, 2, 3],  # trigrams 123 231 312 123: 3 distinct of 4 -> 1/4
        [1, 2, 3, 4, 5, 6],  # all distinct -> 0
        [1, 2],  # shorter than n -> 0
        [],
        [7, 7, 7, 7, 7],  # 777 three times: 1 distinct of 3 -> 2/3
    ]
    expected = [-0.25, 0.0, 0.0, 0.0, -2 / 3]
    extras = {**PROTOCOL_EXTRAS, "completion_ids": completion_ids, "completions": ["text"] * len(completion_ids)}
    assert reward(**extras) == pytest.approx(expected, abs=1e-12)
    assert reward(completion_ids) == pytest.approx(expected, abs=1e-12)

    half = get_repetition_penalty_reward(ngram_size=1, max_penalty=-0.5)
    assert half([[4, 5, 4, 5]]) == [pytest.approx(-0.5 * 0.5)]  # 2 distinct tokens of 4


def test_repetition_penalty_reward_errors():
    with pytest.raises(ConfigError, match="ngram_size"):
        get_repetition_penalty_reward(ngram_size=0)
    with pytest.raises(ConfigError, match="max_penalty"):
        get_repetition_penalty_reward(max_penalty=0.5)


def test_shaping_rewards_pickle_with_their_names():
    """A rollout worker in another process receives the reward functions pickled; the metric takes __name__."""
    import pickle

    for reward, name in [
        (get_repetition_penalty_reward(ngram_size=2), "repetition_penalty_reward"),
        (get_soft_overlong_punishment(10, 4), "soft_overlong_punishment_reward"),
        (get_cosine_scaled_reward(max_len=10), "cosine_scaled_reward"),
    ]:
        copy = pickle.loads(pickle.dumps(reward))
        assert copy.__name__ == name
        assert vars(copy) == vars(reward)


@pytest.mark.skipif(importlib.util.find_spec("math_verify") is None, reason="needs math-verify")
def test_cosine_scaled_reward_by_hand():
    reward = get_cosine_scaled_reward(max_len=100)
    completions = [r"\boxed{\frac{1}{3}}", r"\boxed{\frac{1}{2}}", r"\boxed{\frac{1}{3}}", r"\boxed{42}"]
    solution = [r"\frac{1}{3}", r"\frac{1}{3}", r"\frac{1}{3}", "forty two"]
    ids = [[1] * 25, [1] * 25, [1] * 300, [1] * 5]
    # correct at 25 tokens: 0.5 + 0.25 * (1 + cos(pi / 4)); wrong at 25: -0.5 - 0.25 * (1 + cos(pi / 4));
    # past max_len it stays at the long-length bound; an unparsable gold solution gives None
    high = 0.25 * (1 + math.cos(math.pi / 4))
    assert reward(completions, solution, ids) == [
        pytest.approx(0.5 + high),
        pytest.approx(-0.5 - high),
        pytest.approx(0.5),
        None,
    ]


# ---- JSON -----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "completion, expected",
    [
        ('{"name": "Ada", "age": 36}', 1.0),
        ("[1, 2, 3]", 1.0),
        ('  {"a": 1}\n', 1.0),
        ('Here you go:\n```json\n{"a": 1}\n```\nDone.', 1.0),
        ('```\n{"a": 1}\n```', 1.0),
        ('```json\n{"a": 1}\n```\nfixed:\n```json\n{"a": }\n```', 0.0),  # the last block counts
        ('{"a": }', 0.0),
        ('```python\nx = 1\n```\nAnd the data:\n```json\n{"a": 1}\n```', 1.0),
        ('Here you go: {"a": 1}', 0.0),  # prose around unfenced JSON
        ("", 0.0),
        ("hello", 0.0),
    ],
)
def test_json_reward(completion, expected):
    assert json_reward(completions=[completion], **PROTOCOL_EXTRAS) == [expected]
    assert json_reward(completions=[_chat(completion)]) == [expected]


PERSON_SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer", "minimum": 0}},
    "required": ["name", "age"],
}
SCHEMA_CASES = [
    ('{"name": "Ada", "age": 36}', 1.0),
    ('```json\n{"name": "Ada", "age": 36}\n```', 1.0),
    ('{"name": "Ada", "age": "36"}', 0.0),  # wrong type
    ('{"name": "Ada", "age": -1}', 0.0),  # below the minimum
    ('{"name": "Ada"}', 0.0),  # missing a required key
    ("not json", 0.0),
]


def test_json_schema_reward_from_a_fixed_schema():
    reward = get_json_schema_reward(PERSON_SCHEMA)
    completions = [completion for completion, _ in SCHEMA_CASES]
    expected = [score for _, score in SCHEMA_CASES]
    assert reward(completions=completions, **PROTOCOL_EXTRAS) == expected
    assert reward(completions=[_chat(text) for text in completions]) == expected
    with pytest.raises(ConfigError, match="JSON schema"):
        get_json_schema_reward({"type": 5})


def test_json_schema_reward_from_a_schema_column():
    completions = [completion for completion, _ in SCHEMA_CASES] + ['{"name": "Ada", "age": 36}']
    schemas = [PERSON_SCHEMA, json.dumps(PERSON_SCHEMA)] * 3 + [None]  # dicts, JSON strings, and a row without
    expected = [score for _, score in SCHEMA_CASES] + [None]
    assert json_schema_reward(completions=completions, schema=schemas) == expected
    with pytest.raises(DataError, match="'schema', row 1"):
        json_schema_reward(completions=["{}", "{}"], schema=[PERSON_SCHEMA, {"type": 5}])
    with pytest.raises(DataError, match="needs a 'schema' dataset column"):
        json_schema_reward(completions=["{}"])


# ---- code -----------------------------------------------------------------------------------------------------


def test_extract_code():
    assert extract_code("```python\nx = 1\n```\nthen\n```python\nx = 2\n```") == "x = 2\n"
    assert extract_code("```py\nx = 3\n```") == "x = 3\n"
    assert extract_code("```\nx = 4\n```") == "x = 4\n"
    assert extract_code('```json\n{"a": 1}\n```') == '```json\n{"a": 1}\n```'  # not Python: the whole text
    assert extract_code("x = 5") == "x = 5"
    mixed = '```json\n{"a": 1}\n```\nSome prose.\n```python\nx = 6\n```\n```bash\nls\n```'
    assert extract_code(mixed) == "x = 6\n"  # fences pair up from the start; prose between blocks is no block


def test_unit_tests_from_a_string_or_a_list():
    split = library._unit_tests("import math\nassert f(1) == 2\nx = 1\nassert f(x) == 2\ny = 2", "tests", 0)
    assert split == ["import math\nassert f(1) == 2", "x = 1\nassert f(x) == 2\ny = 2"]
    harness = "def check(candidate):\n    assert candidate(1) == 2\ncheck(f)"
    assert library._unit_tests(harness, "tests", 0) == ["def check(candidate):\n    assert candidate(1) == 2\ncheck(f)"]
    assert library._unit_tests(["assert a", "assert b"], "tests", 0) == ["assert a", "assert b"]
    with pytest.raises(DataError, match="'tests', row 3 is not valid Python"):
        library._unit_tests("assert (", "tests", 3)
    with pytest.raises(DataError, match="'test_cases', row 0 must be a list"):
        library._unit_tests([1, 2], "test_cases", 0)


def test_code_execution_reward_needs_tests():
    with pytest.raises(DataError, match="'test_cases' \\(or 'tests'\\)"):
        REWARD_FUNCTIONS["code_execution_reward"](completions=["x = 1"])


def test_registry_names_match_functions():
    assert sorted(REWARD_FUNCTIONS) == sorted(
        [
            "accuracy_reward",
            "reasoning_accuracy_reward",
            "think_format_reward",
            "repetition_penalty_reward",
            "json_reward",
            "json_schema_reward",
            "code_execution_reward",
        ]
    )
    for name, function in REWARD_FUNCTIONS.items():
        assert function.__name__ == name
