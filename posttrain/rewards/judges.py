"""Judges: compare or check completions, for online preference methods and `WinRateCallback`.

TRL dropped `trl.experimental.judges` in 2026; this module keeps its names and call signatures:

- `BasePairwiseJudge.judge(prompts, completions, shuffle_order=True) -> list[int]`: for each prompt, the index (0 or
  1) of the better of its two completions, -1 when the judge could not decide (e.g. an API answer that is not a
  digit);
- `BaseRankJudge.judge(prompts, completions, shuffle_order=True) -> list[list[int]]`: completion indices, best first;
- `BaseBinaryJudge.judge(prompts, completions, gold_completions=None, shuffle_order=True) -> list[int]`: 1 if the
  completion satisfies the constraint, 0 if not, -1 on failure (CGPO, arXiv:2409.20370, section 4.1.4).

Local judges run here without a network: `RewardModelPairwiseJudge` (a sequence-classification reward model scores
each completion; the higher wins) and `CausalLMPairwiseJudge` (a causal LM reads a comparison prompt and its next-token
logits for "0" and "1" decide). Both can also return soft scores (`return_scores=True`: the probability that the
first completion is better). `HfPairwiseJudge` and `OpenAIPairwiseJudge` ask a remote chat model, as in TRL.
`PairRMJudge` needs the llm-blender package and the PairRM weights from the Hub; without them it says what to use.
"""

from __future__ import annotations

import concurrent.futures
import importlib.util
import logging
from abc import ABC, abstractmethod

import numpy as np
import torch

from posttrain.errors import ConfigError

logger = logging.getLogger("posttrain")

# The placeholders {prompt}, {response0}, {response1} are filled in; the judge must answer with one character.
DEFAULT_PAIRWISE_SYSTEM_PROMPT = """You are comparing two answers to the same request and must pick the better one.

Request:
{prompt}

Answer 0:
{response0}

Answer 1:
{response1}

Which answer is more helpful, correct and relevant to the request? Do not let the order or the length of the \
answers sway you. Reply with a single character: 0 if Answer 0 is better, 1 if Answer 1 is better."""


class BaseJudge(ABC):
    """A judge: subclasses implement `judge`."""

    @abstractmethod
    def judge(self, prompts: list[str], completions: list[str], shuffle_order: bool = True) -> list:
        raise NotImplementedError("Judge subclasses must implement the `judge` method.")


class BaseRankJudge(ABC):
    """Ranks several completions per prompt: `judge` returns, per prompt, the completion indices best first
    (e.g. `[1, 2, 0]`: the second completion is best, then the third, then the first)."""

    @abstractmethod
    def judge(self, prompts: list[str], completions: list[list[str]], shuffle_order: bool = True) -> list[list[int]]:
        raise NotImplementedError("Judge subclasses must implement the `judge` method.")


class BasePairwiseJudge(BaseJudge):
    """Compares two completions per prompt: `judge` returns the index (0 or 1) of the better one, or -1 when the
    judge failed for that prompt (the caller decides how to treat it). `shuffle_order` presents each pair in a
    random order (and maps the answer back) so that a judge biased towards a position is not rewarded for it."""

    @abstractmethod
    def judge(self, prompts: list[str], completions: list[list[str]], shuffle_order: bool = True) -> list[int]:
        raise NotImplementedError("Judge subclasses must implement the `judge` method.")


class BaseBinaryJudge(BaseJudge):
    """Checks one completion per prompt against a constraint: 1 satisfied, 0 not, -1 the check failed
    (CGPO's binary judges, arXiv:2409.20370)."""

    @abstractmethod
    def judge(
        self,
        prompts: list[str],
        completions: list[str],
        gold_completions: list[str] | None = None,
        shuffle_order: bool = True,
    ) -> list[int]:
        raise NotImplementedError("Judge subclasses must implement the `judge` method.")


# -- order shuffling shared by the pairwise judges --------------------------------------------------------------
def _check_pairs(completions) -> None:
    bad = [i for i, pair in enumerate(completions) if len(pair) != 2]
    if bad:
        raise ValueError(
            f"A pairwise judge needs exactly 2 completions per prompt; prompt {bad[0]} has {len(completions[bad[0]])}."
        )


def _flip_mask(n: int, shuffle_order: bool) -> np.ndarray:
    return np.random.choice([True, False], size=n) if shuffle_order else np.zeros(n, dtype=bool)


def _present(completions, flips) -> list[list[str]]:
    return [list(pair[::-1]) if flip else list(pair) for pair, flip in zip(completions, flips, strict=True)]


def _unflip_ranks(ranks, flips) -> list[int]:
    """Maps answers about the presented order back to the caller's order (-1 stays -1)."""
    return [int(r) if r == -1 or not flip else 1 - int(r) for r, flip in zip(ranks, flips, strict=True)]


class ScoringPairwiseJudge(BasePairwiseJudge):
    """A pairwise judge that gives each completion of a pair a score (a logit); the higher wins.

    Subclasses implement `pair_scores(prompts, pairs) -> tensor (n, 2)`. With `return_scores=True`, `judge` returns
    the softmax probability of the first completion over the pair's scores divided by `temperature`
    (a Bradley-Terry win probability: sigmoid((s0 - s1) / temperature)). A tie goes to the first completion as
    presented, so `shuffle_order` breaks ties at random.
    """

    @abstractmethod
    def pair_scores(self, prompts: list, pairs: list[list[str]]) -> torch.Tensor: ...

    def judge(
        self, prompts, completions, shuffle_order: bool = True, return_scores: bool = False, temperature: float = 1.0
    ) -> list:
        _check_pairs(completions)
        if temperature <= 0:
            raise ValueError(f"temperature={temperature} must be > 0.")
        flips = _flip_mask(len(prompts), shuffle_order)
        presented = self.pair_scores(list(prompts), _present(completions, flips)).double()
        if return_scores:  # back in the caller's order
            flipped = torch.as_tensor(flips, dtype=torch.bool).unsqueeze(-1)
            scores = torch.where(flipped, presented.flip(-1), presented)
            return torch.softmax(scores / temperature, dim=-1)[:, 0].tolist()
        first_wins = presented[:, 0] >= presented[:, 1]  # a tie goes to the first as presented
        return _unflip_ranks([0 if w else 1 for w in first_wins.tolist()], flips)


def _texts(tokenizer, prompts, completions) -> list[str]:
    """prompt + completion as the scoring model reads it: conversational prompts (lists of messages) get the
    completion as the assistant's turn, rendered with the tokenizer's chat template; text prompts are concatenated."""
    out = []
    for prompt, completion in zip(prompts, completions, strict=True):
        if isinstance(prompt, list):
            messages = prompt + [{"role": "assistant", "content": completion}]
            out.append(tokenizer.apply_chat_template(messages, tokenize=False))
        else:
            out.append(prompt + completion)
    return out


class RewardModelPairwiseJudge(ScoringPairwiseJudge):
    """A local reward model (a sequence classifier with one label, by hub id, path or object) scores both
    completions; the higher reward wins. This fills PairRM's role (a learned pairwise preference) with any reward
    model posttrain can load, for instance one trained with `RewardTrainer`. Soft scores are the Bradley-Terry
    probability sigmoid((r0 - r1) / temperature)."""

    def __init__(
        self,
        reward_model,
        tokenizer=None,
        batch_size: int = 8,
        max_length: int | None = None,
        model_init_kwargs: dict | None = None,
    ):
        from posttrain.models.loading import load_sequence_classifier, load_tokenizer, resolve_model_path

        if isinstance(reward_model, str):  # a causal LM checkpoint would get a random head: a coin-flip judge
            from transformers import AutoConfig

            architectures = AutoConfig.from_pretrained(resolve_model_path(reward_model)).architectures or []
            if not any(a.endswith("ForSequenceClassification") for a in architectures):
                raise ConfigError(
                    f"{reward_model!r} is not a reward model (its architectures are {architectures}); "
                    "a new classification head would judge at random. Pass a trained reward model, "
                    "e.g. the output of RewardTrainer."
                )
        self.tokenizer = load_tokenizer(reward_model, tokenizer)
        self.model = load_sequence_classifier(reward_model, 1, model_init_kwargs, self.tokenizer).eval()
        self.batch_size, self.max_length = batch_size, max_length

    @torch.no_grad()
    def rewards(self, prompts: list, completions: list[str]) -> torch.Tensor:
        """The reward of each (prompt, completion), shape (n,)."""
        texts = _texts(self.tokenizer, prompts, completions)
        out, padding_side = [], self.tokenizer.padding_side
        self.tokenizer.padding_side = "right"
        try:
            for start in range(0, len(texts), self.batch_size):
                batch = self.tokenizer(
                    texts[start : start + self.batch_size],
                    return_tensors="pt",
                    padding=True,
                    truncation=self.max_length is not None,
                    max_length=self.max_length,
                    add_special_tokens=False,
                ).to(self.model.device)
                out.append(self.model(**batch).logits[:, 0].float().cpu())
        finally:
            self.tokenizer.padding_side = padding_side
        return torch.cat(out) if out else torch.zeros(0)

    def pair_scores(self, prompts, pairs):
        firsts = self.rewards(prompts, [p[0] for p in pairs])
        seconds = self.rewards(prompts, [p[1] for p in pairs])
        return torch.stack([firsts, seconds], dim=-1)


class CausalLMPairwiseJudge(ScoringPairwiseJudge):
    """A local causal LM as the judge (TRL's `HfPairwiseJudge` role, run here instead of on an inference API).

    Each pair fills `system_prompt` (placeholders ``{prompt}``, ``{response0}``, ``{response1}``; default:
    `DEFAULT_PAIRWISE_SYSTEM_PROMPT`), sent as a user message through the tokenizer's chat template with the
    generation prompt (plain text when the tokenizer has no template). The model's next-token logits for "0" and
    "1" are the pair's scores: the judge's answer is the likelier digit, read without sampling, so it is
    deterministic and never invalid, and `return_scores=True` gives the model's probability of "0".
    """

    def __init__(
        self,
        model,
        tokenizer=None,
        system_prompt: str | None = None,
        batch_size: int = 8,
        model_init_kwargs: dict | None = None,
    ):
        from posttrain.models.loading import load_causal_lm, load_tokenizer

        self.tokenizer = load_tokenizer(model, tokenizer)
        self.model = load_causal_lm(model, model_init_kwargs).eval()
        self.system_prompt = system_prompt or DEFAULT_PAIRWISE_SYSTEM_PROMPT
        for key in ("{prompt}", "{response0}", "{response1}"):
            if key not in self.system_prompt:
                raise ConfigError(
                    f"system_prompt must contain the placeholder {key} (it has {{prompt}}, "
                    "{response0} and {response1} filled in)."
                )
        self.batch_size = batch_size
        self.answer_ids = [self._single_token(digit) for digit in ("0", "1")]

    def _single_token(self, text: str) -> int:
        ids = self.tokenizer.encode(text, add_special_tokens=False)
        if len(ids) != 1:
            raise ConfigError(
                f"CausalLMPairwiseJudge reads the logit of the answer {text!r}, but this tokenizer "
                f"splits it into {len(ids)} tokens {ids}; use a model whose tokenizer has a single "
                "token for each digit."
            )
        return ids[0]

    def render(self, prompt, pair) -> str:
        """The text the judge model reads for one pair."""
        if isinstance(prompt, list):  # conversational: the last user turn is the request
            prompt = next((m["content"] for m in reversed(prompt) if m.get("role") == "user"), "")
        content = self.system_prompt.format(prompt=prompt, response0=pair[0], response1=pair[1])
        if getattr(self.tokenizer, "chat_template", None):
            return self.tokenizer.apply_chat_template(
                [{"role": "user", "content": content}], tokenize=False, add_generation_prompt=True
            )
        return content

    @torch.no_grad()
    def pair_scores(self, prompts, pairs):
        texts = [self.render(p, pair) for p, pair in zip(prompts, pairs, strict=True)]
        out, padding_side = [], self.tokenizer.padding_side
        self.tokenizer.padding_side = "left"  # the next-token logits are then at the last position
        try:
            for start in range(0, len(texts), self.batch_size):
                batch = self.tokenizer(
                    texts[start : start + self.batch_size], return_tensors="pt", padding=True, add_special_tokens=False
                ).to(self.model.device)
                logits = self.model(**batch).logits[:, -1, :]
                out.append(logits[:, self.answer_ids].float().cpu())
        finally:
            self.tokenizer.padding_side = padding_side
        return torch.cat(out) if out else torch.zeros(0, 2)


class PairRMJudge(ScoringPairwiseJudge):
    """PairRM (Jiang et al. 2023, llm-blender), as in TRL: needs the `llm-blender` package and the
    ``llm-blender/PairRM`` weights from the Hub (or its local cache). Without them it raises and points to
    `RewardModelPairwiseJudge`, which plays the same role with a local reward model."""

    def __init__(self):
        if importlib.util.find_spec("llm_blender") is None:
            raise ConfigError(
                "PairRMJudge needs the llm-blender package and the llm-blender/PairRM weights from the "
                "Hugging Face Hub, and llm-blender is not installed. Install it (pip install "
                "llm-blender) where the Hub is reachable, or judge with a local reward model instead: "
                "RewardModelPairwiseJudge('path/to/reward-model')."
            )
        import transformers.utils.hub

        if not hasattr(transformers.utils.hub, "TRANSFORMERS_CACHE"):  # llm-blender reads it at import
            transformers.utils.hub.TRANSFORMERS_CACHE = None
        import llm_blender
        from accelerate import Accelerator

        self.blender = llm_blender.Blender()
        self.blender.loadranker("llm-blender/PairRM", device=Accelerator().device)

    def pair_scores(self, prompts, pairs):
        scores = self.blender.rank(prompts, pairs, return_scores=True, disable_tqdm=True)
        return torch.as_tensor(np.asarray(scores, dtype=np.float64))


# -- remote chat models --------------------------------------------------------------------------------------------
class _ChatAPIPairwiseJudge(BasePairwiseJudge):
    """Asks a chat model (one request per pair, run concurrently) to answer "0" or "1"; anything else is -1."""

    system_prompt: str

    @abstractmethod
    def _ask(self, content: str) -> str: ...

    def _rank(self, prompt, pair) -> int:
        content = self.system_prompt.format(prompt=prompt, response0=pair[0], response1=pair[1])
        response = self._ask(content)
        if response in ("0", "1"):
            return int(response)
        logger.debug("The judge answered %r instead of '0' or '1'; counting it as -1.", response)
        return -1

    def judge(self, prompts, completions, shuffle_order: bool = True) -> list[int]:
        _check_pairs(completions)
        flips = _flip_mask(len(prompts), shuffle_order)
        with concurrent.futures.ThreadPoolExecutor() as pool:
            ranks = list(pool.map(self._rank, prompts, _present(completions, flips)))
        return _unflip_ranks(ranks, flips)


class HfPairwiseJudge(_ChatAPIPairwiseJudge):
    """A chat model on Hugging Face's inference API judges each pair (`max_tokens=1`); `system_prompt` (sent as
    the user message) must contain ``{prompt}``, ``{response0}``, ``{response1}`` and ask for a one-character
    answer. Needs the network; for a local model use `CausalLMPairwiseJudge`."""

    def __init__(
        self,
        model: str = "meta-llama/Meta-Llama-3-70B-Instruct",
        token: str | None = None,
        system_prompt: str | None = None,
    ):
        from huggingface_hub import InferenceClient

        self.client = InferenceClient(model=model, token=token)
        self.system_prompt = system_prompt or DEFAULT_PAIRWISE_SYSTEM_PROMPT

    def _ask(self, content: str) -> str:
        reply = self.client.chat_completion(messages=[{"role": "user", "content": content}], max_tokens=1)
        return reply.choices[0].message.content


class OpenAIPairwiseJudge(_ChatAPIPairwiseJudge):
    """An OpenAI chat model judges each pair (`max_tokens=1`), as in TRL. After `max_requests` pairs (None: no
    limit) it stops calling the API and returns -1 for every pair, with a warning once. Needs the `openai` package
    and OPENAI_API_KEY."""

    def __init__(
        self, model: str = "gpt-4-turbo-preview", system_prompt: str | None = None, max_requests: int | None = 1_000
    ):
        if importlib.util.find_spec("openai") is None:
            raise ConfigError(
                "OpenAIPairwiseJudge needs the openai package (pip install openai) and an "
                "OPENAI_API_KEY; for a judge that runs locally use CausalLMPairwiseJudge or "
                "RewardModelPairwiseJudge."
            )
        from openai import OpenAI

        self.client = OpenAI()
        self.model, self.max_requests = model, max_requests
        self.system_prompt = system_prompt or DEFAULT_PAIRWISE_SYSTEM_PROMPT
        self.num_requests, self._warned = 0, False

    def _ask(self, content: str) -> str:
        reply = self.client.chat.completions.create(
            model=self.model, max_tokens=1, messages=[{"role": "user", "content": content}]
        )
        return reply.choices[0].message.content

    def judge(self, prompts, completions, shuffle_order: bool = True) -> list[int]:
        if self.max_requests is not None and self.num_requests >= self.max_requests:
            if not self._warned:
                logger.warning(
                    "OpenAIPairwiseJudge reached max_requests=%d; returning -1 from now on. Raise "
                    "max_requests (None: no limit) to keep judging.",
                    self.max_requests,
                )
                self._warned = True
            return [-1] * len(prompts)
        ranks = super().judge(prompts, completions, shuffle_order)
        self.num_requests += len(prompts)
        return ranks


class AllTrueJudge(BaseBinaryJudge):
    """CGPO's mixture of judges (arXiv:2409.20370): 1 when every inner binary judge says 1, -1 when any failed
    (-1), else 0."""

    def __init__(self, judges: list[BaseBinaryJudge]):
        self.judges = judges

    def judge(self, prompts, completions, gold_completions=None, shuffle_order: bool = True) -> list[int]:
        verdicts = [j.judge(prompts, completions, gold_completions, shuffle_order) for j in self.judges]
        out = []
        for votes in zip(*verdicts, strict=True):
            if any(v not in (0, 1, -1) for v in votes):
                raise ValueError(f"A binary judge returned {votes}; binary judgments must be 0, 1 or -1.")
            out.append(-1 if -1 in votes else int(all(v == 1 for v in votes)))
        return out


__all__ = [
    "AllTrueJudge",
    "BaseBinaryJudge",
    "BaseJudge",
    "BasePairwiseJudge",
    "BaseRankJudge",
    "CausalLMPairwiseJudge",
    "DEFAULT_PAIRWISE_SYSTEM_PROMPT",
    "HfPairwiseJudge",
    "OpenAIPairwiseJudge",
    "PairRMJudge",
    "RewardModelPairwiseJudge",
    "ScoringPairwiseJudge",
]
