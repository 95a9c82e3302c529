import asyncio
import functools
import logging
import math
import threading
import time

import pytest
import torch
from transformers import AutoModelForSequenceClassification, AutoTokenizer

from posttrain.errors import ConfigError, DataError
from posttrain.models.loading import load_sequence_classifier
from posttrain.rewards.scoring import RewardFunctionError, RewardScorer, RewardTimeoutError

PROMPTS = ["one plus two", "the sky is", "what is a cat"]
COMPLETIONS = ["three", "blue", "a small animal"]
IDS = [[1, 2], [3], [4, 5, 6]]


def score(scorer, columns=None, prompts=PROMPTS, completions=COMPLETIONS, trainer_state=None):
    return scorer(prompts, completions, IDS, columns or {}, trainer_state=trainer_state)


def constant(output):
    def reward(completions, **kwargs):
        return output

    return reward


def assert_rows(actual: torch.Tensor, expected: list) -> None:
    """Element-by-element, NaN where NaN is expected."""
    assert actual.dtype == torch.float32
    torch.testing.assert_close(
        actual.double(), torch.tensor(expected, dtype=torch.float64), equal_nan=True, rtol=1e-6, atol=0
    )


# --- keyword arguments by signature ---------------------------------------------------------------------------


def test_each_function_gets_only_the_arguments_its_signature_names():
    received = {}

    def narrow(prompts, completions):
        received["narrow"] = (prompts, completions)
        return [0.0] * len(prompts)

    def with_column(completions, solution, *, trainer_state=None):
        received["with_column"] = (completions, solution, trainer_state)
        return [0.0] * len(completions)

    def everything(**kwargs):
        received["everything"] = kwargs
        return [0.0] * len(kwargs["prompts"])

    scorer = RewardScorer([narrow, with_column, everything])
    columns = {"solution": ["3", "blue", "animal"], "level": [1, 2, 3]}
    score(scorer, columns, trainer_state="STATE")

    assert received["narrow"] == (PROMPTS, COMPLETIONS)
    assert received["with_column"] == (COMPLETIONS, ["3", "blue", "animal"], "STATE")
    assert received["everything"] == {
        "prompts": PROMPTS,
        "completions": COMPLETIONS,
        "completion_ids": IDS,
        "solution": ["3", "blue", "animal"],
        "level": [1, 2, 3],
        "trainer_state": "STATE",
        "log_metric": received["everything"]["log_metric"],  # callables: no-ops without a trainer
        "log_extra": received["everything"]["log_extra"],
    }
    assert callable(received["everything"]["log_metric"]) and callable(received["everything"]["log_extra"])


def test_names_come_from_functions_partials_and_are_made_unique():
    def length_reward(completions, factor=1.0):
        return [factor * len(c) for c in completions]

    scorer = RewardScorer([length_reward, functools.partial(length_reward, factor=2.0), constant([1, 1, 1])])
    assert scorer.names == ["length_reward", "length_reward_2", "reward"]
    rewards, _ = score(scorer)
    assert_rows(rewards, [[5, 10, 1], [4, 8, 1], [14, 28, 1]])


def test_sync_functions_run_in_the_calling_thread():
    threads = []

    def record(completions):
        threads.append(threading.current_thread())
        return [1.0] * len(completions)

    score(RewardScorer([record]))
    assert threads == [threading.current_thread()]


# --- weights and None -----------------------------------------------------------------------------------------


def test_weighted_sum_skips_functions_that_do_not_apply():
    scorer = RewardScorer([constant([1.0, 2.0, 3.0]), constant([10, None, -30])], reward_weights=[0.5, 2.0])
    rewards, total = score(scorer)
    assert_rows(rewards, [[1.0, 10.0], [2.0, math.nan], [3.0, -30.0]])
    # 0.5 * 1 + 2 * 10; 0.5 * 2 (second not applicable); 0.5 * 3 + 2 * -30
    assert_rows(total, [20.5, 1.0, -58.5])


def test_default_weights_are_one_and_bools_count_as_numbers():
    rewards, total = score(RewardScorer([constant([True, False, 0.25]), constant([1, 2, 3])]))
    assert_rows(rewards, [[1.0, 1.0], [0.0, 2.0], [0.25, 3.0]])
    assert_rows(total, [2.0, 2.0, 3.25])


def test_a_sample_no_function_applies_to_gets_nan():
    scorer = RewardScorer([constant([None, 1.0, None]), constant([None, None, 4.0])], reward_weights=[1.0, -1.0])
    rewards, total = score(scorer)
    assert_rows(rewards, [[math.nan, math.nan], [1.0, math.nan], [math.nan, 4.0]])
    assert_rows(total, [math.nan, 1.0, -4.0])


def test_no_function_applying_to_any_sample_is_an_error():
    scorer = RewardScorer([constant([None] * 3), constant([None] * 3)])
    with pytest.raises(
        DataError, match="No reward function applies to this batch: reward, reward_2 returned None for all 3 samples"
    ):
        score(scorer)


# --- setting errors -------------------------------------------------------------------------------------------


def test_weights_of_the_wrong_length():
    with pytest.raises(
        ConfigError, match=r"number of reward_weights \(3\) must match the number of reward functions \(2\)"
    ):
        RewardScorer([constant([1] * 3), constant([1] * 3)], reward_weights=[1.0, 2.0, 3.0])


def test_bad_weight_and_bad_entry():
    with pytest.raises(ConfigError, match=r"reward_weights\[1\]=nan is not a finite number"):
        RewardScorer([constant([1] * 3), constant([1] * 3)], reward_weights=[1.0, math.nan])
    with pytest.raises(ConfigError, match=r"reward_funcs\[0\] is a int"):
        RewardScorer([3])
    with pytest.raises(ConfigError, match="No reward functions given"):
        RewardScorer([])


def test_processing_class_for_a_function_is_rejected(tokenizer):
    with pytest.raises(
        ConfigError,
        match=r"reward_processing_classes\[0\] is set, but reward_funcs\[0\] \(reward\) "
        "is a function",
    ):
        RewardScorer([constant([1] * 3)], reward_processing_classes=[tokenizer])
    with pytest.raises(ConfigError, match=r"reward_processing_classes \(2\) must match .* \(1\)"):  # TRL's words
        RewardScorer([constant([1] * 3)], reward_processing_classes=[None, None])


def test_processing_classes_one_per_function_and_a_single_one_taken_as_a_list(tiny_model_path, tokenizer):
    reward_model = AutoModelForSequenceClassification.from_pretrained(tiny_model_path, num_labels=1)
    scorer = RewardScorer([reward_model], reward_processing_classes=tokenizer)  # not a list: TRL accepts it
    assert scorer.processing_classes == [tokenizer]
    scorer = RewardScorer([constant([1] * 3), reward_model], reward_processing_classes=[None, tokenizer])
    assert scorer.processing_classes == [None, tokenizer]
    with pytest.raises(ConfigError, match="must match"):
        RewardScorer([constant([1] * 3), reward_model], reward_processing_classes=tokenizer)


# --- columns --------------------------------------------------------------------------------------------------


def test_check_columns_names_function_parameter_and_columns():
    def needs_solution(completions, solution, tolerance=0.1):
        return [0.0] * len(completions)

    scorer = RewardScorer([needs_solution])
    scorer.check_columns(["solution"])
    with pytest.raises(
        DataError,
        match=r"'needs_solution' has a required parameter 'solution' .* \(columns: "
        r"\['answer', 'level'\]\)",
    ):
        scorer.check_columns(["level", "answer"])
    with pytest.raises(DataError, match="required parameter 'solution'"):  # checked on every call too
        score(scorer, {"answer": ["3", "blue", "animal"]})


def test_columns_must_not_shadow_standard_arguments_and_must_match_the_batch():
    scorer = RewardScorer([constant([1.0] * 3)])
    with pytest.raises(DataError, match=r"column\(s\) \['completions'\] have the name of a standard"):
        scorer.check_columns(["completions", "solution"])
    with pytest.raises(DataError, match="3 prompts, but column 'solution' has 2"):
        score(scorer, {"solution": ["a", "b"]})


# --- function errors ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "output, message",
    [
        ([1.0, 2.0], "'reward' returned 2 values for 3 samples"),
        (torch.ones(3), "'reward' returned a Tensor for 3 samples"),
        ([1.0, "0.5", 2.0], r"'reward' returned a str \('0.5'\) for sample 1 \(prompt: 'the sky is'\)"),
        (
            [1.0, 2.0, math.nan],
            r"'reward' returned a non-finite reward \(nan\) for sample 2 \(prompt: 'what is a cat'\)",
        ),
        ([math.inf, 2.0, 1.0], r"returned a non-finite reward \(inf\) for sample 0"),
    ],
)
def test_bad_outputs_name_the_function_and_the_sample(output, message):
    with pytest.raises(RewardFunctionError, match=message):
        score(RewardScorer([constant(output)]))


def test_an_exception_names_the_first_sample_that_fails_alone():
    def divide(completions, denominator):
        return [len(c) / d for c, d in zip(completions, denominator)]

    long_prompt = [{"role": "user", "content": "x" * 100}]
    prompts = [[{"role": "user", "content": "hi"}], long_prompt, [{"role": "user", "content": "ho"}]]
    with pytest.raises(
        RewardFunctionError,
        match=r"'divide' failed on sample 1 \(prompt: 'x{60}\.\.\.'\): "
        "ZeroDivisionError: division by zero",
    ) as info:
        score(RewardScorer([divide]), {"denominator": [1, 0, 0]}, prompts=prompts)
    assert isinstance(info.value.__cause__, ZeroDivisionError)


def test_an_exception_only_on_the_whole_batch():
    def needs_two(completions):
        if len(completions) < 2:
            raise RuntimeError("need a pair")
        raise KeyError("batch")

    with pytest.raises(RewardFunctionError, match=r"'needs_two' failed on sample 0 .*RuntimeError: need a pair"):
        score(RewardScorer([needs_two]))

    def fails_on_batch(completions):
        if len(completions) > 1:
            raise KeyError("batch")
        return [1.0]

    with pytest.raises(
        RewardFunctionError,
        match="'fails_on_batch' failed on a batch of 3 samples \\(each sample alone succeeds\\): KeyError: 'batch'",
    ):
        score(RewardScorer([fails_on_batch]))


def test_data_errors_raised_by_a_function_pass_through():
    def needs_column(completions):
        raise DataError("needs_column needs a 'solution' dataset column")

    with pytest.raises(DataError, match="^needs_column needs a 'solution' dataset column$"):
        score(RewardScorer([needs_column]))


# --- async functions ------------------------------------------------------------------------------------------


async def slow_length(completions):
    await asyncio.sleep(0.5)
    return [float(len(c)) for c in completions]


class SlowFirstLetter:
    """An object with an async __call__ is an async reward function too."""

    async def __call__(self, completions, prompts):
        await asyncio.sleep(0.5)
        return [float(ord(c[0]) - ord(p[0])) for c, p in zip(completions, prompts)]


def test_async_functions_run_concurrently():
    scorer = RewardScorer([slow_length, SlowFirstLetter()], reward_weights=[1.0, 0.5])
    assert scorer.names == ["slow_length", "SlowFirstLetter"]
    start = time.perf_counter()
    rewards, total = score(scorer)
    elapsed = time.perf_counter() - start
    assert elapsed < 0.8, elapsed
    expected = [[5.0, 116 - 111], [4.0, 98 - 116], [14.0, 97 - 119]]  # lengths; 't'-'o', 'b'-'t', 'a'-'w
    assert_rows(rewards, expected)
    assert_rows(total, [a + 0.5 * b for a, b in expected])


def test_async_functions_run_while_sync_functions_run():
    def slow_sync(completions):
        time.sleep(0.5)
        return [1.0] * len(completions)

    start = time.perf_counter()
    rewards, _ = score(RewardScorer([slow_sync, slow_length]))
    assert time.perf_counter() - start < 0.8
    assert_rows(rewards, [[1.0, 5.0], [1.0, 4.0], [1.0, 14.0]])


def test_a_slow_async_function_hits_the_timeout():
    async def stuck(completions):
        await asyncio.sleep(5)
        return [1.0] * len(completions)

    async def quick(completions):
        return [1.0] * len(completions)

    start = time.perf_counter()
    with pytest.raises(RewardTimeoutError, match=r"'stuck' did not finish within timeout_s=0.2 s on a batch of 3"):
        score(RewardScorer([quick, stuck], timeout_s=0.2))
    assert time.perf_counter() - start < 1.5


def test_a_timeout_the_function_raises_itself_is_a_failure():
    async def flaky(completions):
        raise TimeoutError("upstream server")

    with pytest.raises(RewardFunctionError, match="'flaky' failed on sample 0 .*TimeoutError: upstream server"):
        score(RewardScorer([flaky]))


def test_an_async_exception_names_the_sample():
    async def picky(completions):
        await asyncio.sleep(0)
        if "blue" in completions:
            raise ValueError("no colours")
        return [1.0] * len(completions)

    with pytest.raises(
        RewardFunctionError,
        match=r"'picky' failed on sample 1 \(prompt: 'the sky is'\): "
        "ValueError: no colours",
    ):
        score(RewardScorer([picky, constant([1.0] * 3)]))


# --- reward models --------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def classifier_path(tiny_model_path, tmp_path_factory):
    """A saved sequence classifier (tiny Llama + a random score head), so that every load has the same head."""
    model = load_sequence_classifier(tiny_model_path)
    path = tmp_path_factory.mktemp("classifier") / "rm"
    model.save_pretrained(path)
    AutoTokenizer.from_pretrained(tiny_model_path).save_pretrained(path)
    return str(path)


def direct_scores(path: str, token_ids: list[list[int]]) -> list[float]:
    """Each text through an independently loaded classifier on its own: no padding, last position's logit."""
    model = AutoModelForSequenceClassification.from_pretrained(path, dtype=torch.float64).eval()
    with torch.no_grad():
        return [model(input_ids=torch.tensor([ids])).logits[0, 0].item() for ids in token_ids]


def test_model_reward_equals_an_unpadded_forward_of_prompt_plus_completion(classifier_path, tokenizer):
    scorer = RewardScorer([classifier_path, constant([1.0, 1.0, 1.0])], reward_weights=[2.0, 1.0])
    assert scorer.names == [classifier_path, "reward"]
    rewards, total = score(scorer)

    texts = [p + c for p, c in zip(PROMPTS, COMPLETIONS)]
    token_ids = [tokenizer(text)["input_ids"] for text in texts]
    assert len({len(ids) for ids in token_ids}) > 1  # the batch needs padding
    expected = direct_scores(classifier_path, token_ids)
    assert len({round(x, 6) for x in expected}) == 3
    assert rewards[:, 0].tolist() == pytest.approx(expected, abs=1e-5)
    assert total.tolist() == pytest.approx([2 * x + 1.0 for x in expected], abs=1e-5)


def test_conversational_model_reward_uses_the_chat_template(classifier_path, tokenizer):
    model = AutoModelForSequenceClassification.from_pretrained(classifier_path)
    scorer = RewardScorer([model], reward_processing_classes=[tokenizer])
    assert scorer.names == [classifier_path]
    prompts = [[{"role": "user", "content": p}] for p in PROMPTS]
    completions = [[{"role": "assistant", "content": c}] for c in COMPLETIONS]
    rewards, _ = score(scorer, prompts=prompts, completions=completions)

    texts = [
        f"<|im_start|>user\n{p}<|im_end|>\n<|im_start|>assistant\n{c}<|im_end|>\n" for p, c in zip(PROMPTS, COMPLETIONS)
    ]
    token_ids = [tokenizer(text, add_special_tokens=False)["input_ids"] for text in texts]
    assert rewards[:, 0].tolist() == pytest.approx(direct_scores(classifier_path, token_ids), abs=1e-5)


def test_conversational_model_reward_needs_a_chat_template(classifier_path, fresh_tokenizer):
    fresh_tokenizer.chat_template = None
    scorer = RewardScorer([classifier_path], reward_processing_classes=[fresh_tokenizer])
    with pytest.raises(DataError, match="no chat template"):
        score(scorer, prompts=[[{"role": "user", "content": p}] for p in PROMPTS])


def test_model_reward_tokenizer_without_pad_token_pads_with_eos(classifier_path, fresh_tokenizer, caplog):
    fresh_tokenizer.pad_token = None
    with caplog.at_level(logging.WARNING):
        scorer = RewardScorer([classifier_path], reward_processing_classes=[fresh_tokenizer])
    assert fresh_tokenizer.pad_token == fresh_tokenizer.eos_token == "<|im_end|>"
    assert "no pad token" in caplog.text
    rewards, _ = score(scorer)
    token_ids = [fresh_tokenizer(p + c)["input_ids"] for p, c in zip(PROMPTS, COMPLETIONS)]
    assert rewards[:, 0].tolist() == pytest.approx(direct_scores(classifier_path, token_ids), abs=1e-5)


def test_a_causal_lm_object_is_not_a_reward_model(tiny_model_path):
    from transformers import AutoModelForCausalLM

    with pytest.raises(ConfigError, match="LlamaForCausalLM is not a sequence classifier"):
        RewardScorer([AutoModelForCausalLM.from_pretrained(tiny_model_path)])


def test_tokenizer_special_tokens_go_on_plain_text_but_not_on_rendered_conversations(classifier_path, fresh_tokenizer):
    from tokenizers import processors

    start_id = fresh_tokenizer.convert_tokens_to_ids("<|im_start|>")
    fresh_tokenizer._tokenizer.post_processor = processors.TemplateProcessing(
        single="<|im_start|> $A", special_tokens=[("<|im_start|>", start_id)]
    )
    scorer = RewardScorer([classifier_path], reward_processing_classes=[fresh_tokenizer])
    plain = [
        [start_id] + fresh_tokenizer(p + c, add_special_tokens=False)["input_ids"] for p, c in zip(PROMPTS, COMPLETIONS)
    ]
    rewards, _ = score(scorer)
    assert rewards[:, 0].tolist() == pytest.approx(direct_scores(classifier_path, plain), abs=1e-5)

    chat = [
        fresh_tokenizer(
            f"<|im_start|>user\n{p}<|im_end|>\n<|im_start|>assistant\n{c}<|im_end|>\n", add_special_tokens=False
        )["input_ids"]
        for p, c in zip(PROMPTS, COMPLETIONS)
    ]
    rewards, _ = score(
        scorer,
        prompts=[[{"role": "user", "content": p}] for p in PROMPTS],
        completions=[[{"role": "assistant", "content": c}] for c in COMPLETIONS],
    )
    assert rewards[:, 0].tolist() == pytest.approx(direct_scores(classifier_path, chat), abs=1e-5)


def test_skip_policy_scores_the_batch_without_a_failing_function_and_counts_it():
    calls = {"n": 0}

    def flaky(completions, **kwargs):
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("boom")
        if calls["n"] == 2:
            return [float("nan")] * len(completions)
        return [1.0] * len(completions)

    def steady(completions, **kwargs):
        return [0.5] * len(completions)

    async def slow(completions, **kwargs):
        await asyncio.sleep(5)
        return [2.0] * len(completions)

    scorer = RewardScorer([flaky, steady, slow], timeout_s=0.2, failure_policy="skip")
    for expected_flaky in (math.nan, math.nan, 1.0):
        per_function, total = scorer(["p", "q"], ["a", "b"], [[1], [2]], {})
        got = per_function[:, 0].tolist()
        assert all(math.isnan(v) for v in got) if math.isnan(expected_flaky) else got == [1.0, 1.0]
        assert per_function[:, 1].tolist() == [0.5, 0.5] and per_function[:, 2].isnan().all()
        assert total.tolist() == [0.5 + (0 if math.isnan(expected_flaky) else 1.0)] * 2
    assert scorer.pop_faults() == {"flaky": 2, "steady": 0, "slow": 3}
    assert scorer.pop_faults() == {"flaky": 0, "steady": 0, "slow": 0}
    # The default stops at the first failure, naming the function.
    with pytest.raises(RewardFunctionError, match="flaky"):
        calls["n"] = 0
        RewardScorer([flaky])(["p"], ["a"], [[1]], {})
    with pytest.raises(ConfigError, match="reward_failure_policy='ignore'"):
        RewardScorer([steady], failure_policy="ignore")


def test_log_metric_reaches_the_function_and_defaults_to_a_no_op():
    recorded = []

    def reward(completions, log_metric, **kwargs):
        log_metric("twice", 2.0 * len(completions))
        return [1.0] * len(completions)

    RewardScorer([reward])(["p"] * 3, ["c"] * 3, [[1]] * 3, {}, log_metric=lambda n, v: recorded.append((n, v)))
    assert recorded == [("twice", 6.0)]
    RewardScorer([reward])(["p"] * 2, ["c"] * 2, [[1]] * 2, {})  # no trainer: ignored


def test_log_extra_hands_on_one_value_per_completion():
    columns = {}

    def reward(completions, log_extra, **kwargs):
        log_extra("first_letter", [c[:1] for c in completions])
        return [1.0] * len(completions)

    RewardScorer([reward])(["p"] * 2, ["ab", "cd"], [[1]] * 2, {}, log_extra=columns.__setitem__)
    assert columns == {"first_letter": ["a", "c"]}

    def wrong(completions, log_extra, **kwargs):
        log_extra("short", ["x"])
        return [1.0] * len(completions)

    with pytest.raises(DataError, match=r"log_extra\('short', ...\) got 1 values for 2 completions"):
        RewardScorer([wrong])(["p"] * 2, ["ab", "cd"], [[1]] * 2, {})
