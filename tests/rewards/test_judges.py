"""Judges (posttrain.experimental.judges, TRL's dropped trl.experimental.judges API): order shuffling, the local
reward-model and causal-LM judges against float64 recomputations of their scores, PairRM / HF / OpenAI judges with
stand-ins for their remote parts, and CGPO's AllTrueJudge."""

import importlib.machinery
import math
import sys
import types

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from posttrain.errors import ConfigError
from posttrain.experimental.judges import (
    DEFAULT_PAIRWISE_SYSTEM_PROMPT,
    AllTrueJudge,
    BaseBinaryJudge,
    BasePairwiseJudge,
    CausalLMPairwiseJudge,
    HfPairwiseJudge,
    OpenAIPairwiseJudge,
    PairRMJudge,
    RewardModelPairwiseJudge,
    ScoringPairwiseJudge,
)

PROMPTS = ["the sky is", "one two", "a cat is", "hello", "what is the sum", "red green"]
PAIRS = [
    [" blue", " green sun"],
    [" three", " four five six"],
    [" good", " bad"],
    [" world", " world!"],
    [" ten", " two plus two"],
    [" blue moon", " one"],
]


def _sigmoid(x):
    return 1.0 / (1.0 + math.exp(-x))


class _LongerWins(ScoringPairwiseJudge):
    """Scores = lengths: the longer completion wins, whatever the order it is shown in."""

    def __init__(self):
        self.seen = []

    def pair_scores(self, prompts, pairs):
        self.seen.append([list(p) for p in pairs])
        return torch.tensor([[float(len(a)), float(len(b))] for a, b in pairs])


def test_shuffled_order_is_mapped_back():
    np.random.seed(0)
    judge = _LongerWins()
    expected = [0 if len(a) >= len(b) else 1 for a, b in PAIRS]
    for _ in range(5):
        assert judge.judge(PROMPTS, PAIRS, shuffle_order=True) == expected
    # with shuffling some pairs were shown flipped, without it none are
    assert any(seen != PAIRS for seen in judge.seen)
    judge.seen.clear()
    assert judge.judge(PROMPTS, PAIRS, shuffle_order=False) == expected
    assert judge.seen == [PAIRS]
    probs = judge.judge(PROMPTS, PAIRS, shuffle_order=True, return_scores=True, temperature=4.0)
    for p, (a, b) in zip(probs, PAIRS):
        assert p == pytest.approx(_sigmoid((len(a) - len(b)) / 4.0), abs=1e-12)
    with pytest.raises(ValueError, match="exactly 2 completions"):
        judge.judge(["x"], [["a", "b", "c"]])


def test_a_position_biased_judge_is_not_rewarded_for_its_bias():
    class FirstShown(ScoringPairwiseJudge):
        def pair_scores(self, prompts, pairs):
            return torch.tensor([[1.0, 0.0]] * len(pairs))

    np.random.seed(1)
    ranks = FirstShown().judge(["p"] * 400, [["a", "b"]] * 400, shuffle_order=True)
    assert 0.4 < sum(ranks) / 400 < 0.6  # the bias is spread over both positions
    assert FirstShown().judge(["p"] * 4, [["a", "b"]] * 4, shuffle_order=False) == [0, 0, 0, 0]


@pytest.fixture(scope="module")
def reward_judge(tiny_model_path, tmp_path_factory):
    """A judge from a saved reward-model checkpoint (the tiny model with a random but fixed scoring head)."""
    from posttrain.models.loading import load_sequence_classifier

    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("rm") / "reward_model"
    load_sequence_classifier(tiny_model_path).save_pretrained(path)
    AutoTokenizer.from_pretrained(tiny_model_path).save_pretrained(path)
    return RewardModelPairwiseJudge(str(path), batch_size=4)


def test_reward_model_judge_refuses_a_model_without_a_trained_head(tiny_model_path):
    with pytest.raises(ConfigError, match="not a reward model"):
        RewardModelPairwiseJudge(tiny_model_path)
    with pytest.raises(ConfigError, match="not a sequence classifier"):
        RewardModelPairwiseJudge(AutoModelForCausalLM.from_pretrained(tiny_model_path))


def _reward64(judge, text):
    ids = judge.tokenizer(text, return_tensors="pt", add_special_tokens=False)
    with torch.no_grad():
        return judge.model(**ids).logits[0, 0].double().item()


def test_reward_model_judge_matches_unbatched_rewards(reward_judge):
    np.random.seed(2)
    rewards = [(_reward64(reward_judge, p + a), _reward64(reward_judge, p + b)) for p, (a, b) in zip(PROMPTS, PAIRS)]
    assert len({round(r0 - r1, 6) for r0, r1 in rewards}) > 1  # the rewards discriminate
    probs = reward_judge.judge(PROMPTS, PAIRS, shuffle_order=True, return_scores=True, temperature=0.5)
    for p, (r0, r1) in zip(probs, rewards):
        assert p == pytest.approx(_sigmoid((r0 - r1) / 0.5), abs=1e-5)
    ranks = reward_judge.judge(PROMPTS, PAIRS, shuffle_order=True)
    assert ranks == [0 if r0 >= r1 else 1 for r0, r1 in rewards]


def test_reward_model_judge_renders_conversational_prompts(reward_judge):
    prompt = [{"role": "user", "content": "the sky is"}]
    text = reward_judge.tokenizer.apply_chat_template(
        prompt + [{"role": "assistant", "content": " blue"}], tokenize=False
    )
    other = reward_judge.tokenizer.apply_chat_template(
        prompt + [{"role": "assistant", "content": " red"}], tokenize=False
    )
    expected = _sigmoid(_reward64(reward_judge, text) - _reward64(reward_judge, other))
    got = reward_judge.judge([prompt], [[" blue", " red"]], shuffle_order=False, return_scores=True)
    assert got[0] == pytest.approx(expected, abs=1e-5)


def test_causal_lm_judge_reads_the_digit_logits(tiny_model_path):
    judge = CausalLMPairwiseJudge(tiny_model_path, batch_size=4)
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_path)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path).double().eval()
    zero, one = tokenizer.encode("0", add_special_tokens=False), tokenizer.encode("1", add_special_tokens=False)
    assert len(zero) == len(one) == 1

    def p_first(prompt, a, b):  # the judge model's probability of "0" when shown (a, b)
        content = (
            DEFAULT_PAIRWISE_SYSTEM_PROMPT.replace("{prompt}", prompt)
            .replace("{response0}", a)
            .replace("{response1}", b)
        )
        text = f"<|im_start|>user\n{content}<|im_end|>\n<|im_start|>assistant\n"  # the tiny ChatML template
        ids = tokenizer(text, return_tensors="pt", add_special_tokens=False)
        with torch.no_grad():
            logits = model(**ids).logits[0, -1]
        return _sigmoid((logits[zero[0]] - logits[one[0]]).item())

    expected = [p_first(prompt, a, b) for prompt, (a, b) in zip(PROMPTS, PAIRS)]
    shown_flipped = [1 - p_first(prompt, b, a) for prompt, (a, b) in zip(PROMPTS, PAIRS)]
    probs = judge.judge(PROMPTS, PAIRS, shuffle_order=False, return_scores=True)
    assert probs == pytest.approx(expected, abs=1e-4)
    assert judge.judge(PROMPTS, PAIRS, shuffle_order=False) == [0 if p >= 0.5 else 1 for p in expected]
    np.random.seed(3)
    flips = np.random.choice([True, False], size=len(PROMPTS))
    assert flips.any() and not flips.all()
    np.random.seed(3)
    probs = judge.judge(PROMPTS, PAIRS, shuffle_order=True, return_scores=True)
    assert probs == pytest.approx([f if flip else e for e, f, flip in zip(expected, shown_flipped, flips)], abs=1e-4)
    with pytest.raises(ConfigError, match=r"\{response1\}"):
        CausalLMPairwiseJudge(judge.model, judge.tokenizer, system_prompt="{prompt} {response0}")


def _fake_module(monkeypatch, name, **attrs):
    module = types.ModuleType(name)
    module.__spec__ = importlib.machinery.ModuleSpec(name, None)
    for key, value in attrs.items():
        setattr(module, key, value)
    monkeypatch.setitem(sys.modules, name, module)
    return module


def test_pairrm_without_llm_blender_points_to_the_local_judge(monkeypatch):
    monkeypatch.setattr(
        "importlib.util.find_spec",
        lambda name, *a: None if name == "llm_blender" else importlib.machinery.PathFinder.find_spec(name),
    )
    with pytest.raises(ConfigError, match="RewardModelPairwiseJudge"):
        PairRMJudge()


def test_pairrm_uses_blender_scores(monkeypatch):
    class Blender:
        def loadranker(self, name, device=None):
            self.name = name

        def rank(self, prompts, pairs, return_scores=False, disable_tqdm=False):
            assert return_scores
            return np.array([[float(len(a)), float(len(b))] for a, b in pairs])

    _fake_module(monkeypatch, "llm_blender", Blender=Blender)
    judge = PairRMJudge()
    assert judge.blender.name == "llm-blender/PairRM"
    np.random.seed(4)
    assert judge.judge(PROMPTS, PAIRS) == [0 if len(a) >= len(b) else 1 for a, b in PAIRS]
    probs = judge.judge(PROMPTS, PAIRS, return_scores=True, temperature=2.0)
    assert probs == pytest.approx([_sigmoid((len(a) - len(b)) / 2.0) for a, b in PAIRS], abs=1e-12)


class _Reply:
    def __init__(self, text):
        self.choices = [types.SimpleNamespace(message=types.SimpleNamespace(content=text))]


def _answer(content):
    """A stand-in chat model: prefers the answer containing 'good'; says something invalid for 'hello'."""
    if "hello" in content:
        return "maybe"
    zero = content.split("Answer 0:")[1].split("Answer 1:")[0]
    return "0" if "good" in zero else "1"


def test_hf_pairwise_judge_maps_answers_and_failures(monkeypatch):
    judge = HfPairwiseJudge()
    judge.client = types.SimpleNamespace(
        chat_completion=lambda messages, max_tokens: _Reply(_answer(messages[0]["content"]))
    )
    prompts = ["a cat is", "a dog is", "hello"]
    pairs = [[" good", " bad"], [" bad", " good"], [" good", " bad"]]
    np.random.seed(5)
    for _ in range(4):
        assert judge.judge(prompts, pairs) == [0, 1, -1]


def test_openai_judge_needs_the_package_and_stops_at_max_requests(monkeypatch):
    monkeypatch.setattr(
        "importlib.util.find_spec",
        lambda name, *a: None if name == "openai" else importlib.machinery.PathFinder.find_spec(name),
    )
    with pytest.raises(ConfigError, match="pip install openai"):
        OpenAIPairwiseJudge()
    monkeypatch.undo()

    calls = []

    class OpenAI:
        def __init__(self):
            def create(model, max_tokens, messages):
                calls.append(model)
                return _Reply(_answer(messages[0]["content"]))

            self.chat = types.SimpleNamespace(completions=types.SimpleNamespace(create=create))

    _fake_module(monkeypatch, "openai", OpenAI=OpenAI)
    judge = OpenAIPairwiseJudge(model="m", max_requests=3)
    assert judge.judge(["x", "y"], [[" good", " bad"], [" bad", " good"]], shuffle_order=False) == [0, 1]
    assert judge.judge(["x", "y"], [[" bad", " good"], [" bad", " good"]], shuffle_order=False) == [1, 1]
    assert judge.judge(["x"], [[" good", " bad"]]) == [-1]  # 4 requests made >= max_requests=3
    assert calls == ["m"] * 4


def test_all_true_judge():
    class Fixed(BaseBinaryJudge):
        def __init__(self, out):
            self.out, self.calls = out, []

        def judge(self, prompts, completions, gold_completions=None, shuffle_order=True):
            self.calls.append((prompts, completions, gold_completions, shuffle_order))
            return self.out

    a, b = Fixed([1, 1, 0, 1, -1]), Fixed([1, 0, 0, -1, 1])
    judge = AllTrueJudge([a, b])
    assert judge.judge(list("pqrst"), list("abcde"), ["g"] * 5, False) == [1, 0, 0, -1, -1]
    assert a.calls == b.calls == [(list("pqrst"), list("abcde"), ["g"] * 5, False)]
    with pytest.raises(ValueError, match="0, 1 or -1"):
        AllTrueJudge([Fixed([2])]).judge(["p"], ["c"])


def test_custom_judges_subclass_the_bases():
    class LengthJudge(BasePairwiseJudge):
        def judge(self, prompts, completions, shuffle_order=True):
            return [0 if len(a) > len(b) else 1 for a, b in completions]

    assert LengthJudge().judge(["p"], [["aaa", "b"]]) == [0]
    with pytest.raises(TypeError):
        BasePairwiseJudge()
