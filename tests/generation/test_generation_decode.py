"""The transformers backend's own decode loop: one prefill per distinct prompt with the KV cache copied to the
group, finished rows leaving the batch, the sampler's log-probs. Each saving must leave the sampled tokens as
they were: the reference is transformers' `generate` with the same per-row Gumbel streams, and the log-probs are
checked against an unpadded float64 forward of prompt + completion."""

import pytest
import torch
from test_generation import model, prompts  # noqa: F401  (the same tiny model and prompts as the backend tests)
from transformers import AutoModelForCausalLM

from posttrain.generation import SamplingParams, TransformersBackend
from posttrain.generation.base import completion_seeds


@pytest.fixture(scope="module")
def stops(model, tokenizer, prompts):
    """Stop tokens that the random tiny model samples early, so that completions end at different steps."""
    backend = TransformersBackend(model, tokenizer.pad_token_id, [tokenizer.eos_token_id])
    free = backend.generate(prompts, 4, SamplingParams(max_tokens=12, temperature=1.5), seed=3)
    greedy = backend.generate(prompts, 1, SamplingParams(max_tokens=12, top_k=1))
    return [tokenizer.eos_token_id, free[0].token_ids[2], free[5].token_ids[4], greedy[0].token_ids[3]]


def _backend(model, tokenizer, stops, **options):
    return TransformersBackend(model, tokenizer.pad_token_id, stops, return_logprobs=True, **options)


VARIANTS = [dict(share_prefill=s, drop_finished=d) for s in (True, False) for d in (True, False)]
SAMPLINGS = [
    SamplingParams(max_tokens=12, top_k=1),  # greedy
    SamplingParams(max_tokens=12, temperature=1.5),
    SamplingParams(max_tokens=12, temperature=0.8, top_k=20, repetition_penalty=1.3),
]


@pytest.mark.parametrize("sampling", SAMPLINGS, ids=["greedy", "t1.5", "t0.8-topk-penalty"])
def test_every_decode_variant_samples_what_generate_samples(model, tokenizer, prompts, stops, sampling):
    """Exact equality holds, not only equality in distribution, because every row draws its Gumbel noise from
    its own generator, which advances once per step whichever rows share the batch: the variants differ only in
    float rounding of the logits (other batch shapes), which could flip a near-tie on another model or machine
    but does not on this one. The log-probs agree to rounding."""
    seeds = completion_seeds([21, 22, 23], 3, 4)
    reference = TransformersBackend(model, tokenizer.pad_token_id, stops).generate_with_transformers(
        model, prompts, 4, sampling, seeds
    )
    assert len({len(c.token_ids) for c in reference}) >= 2 and any(not c.finished_with_eos for c in reference)
    logprobs = None
    for variant in VARIANTS:
        completions = _backend(model, tokenizer, stops, **variant).generate(prompts, 4, sampling, seed=[21, 22, 23])
        assert [c.token_ids for c in completions] == [c.token_ids for c in reference], variant
        assert [c.finished_with_eos for c in completions] == [c.finished_with_eos for c in reference]
        assert [c.prompt_index for c in completions] == [i // 4 for i in range(12)]
        flat = torch.tensor([x for c in completions for x in c.logprobs])
        logprobs = flat if logprobs is None else logprobs
        torch.testing.assert_close(flat, logprobs, rtol=0, atol=1e-5)


@pytest.mark.parametrize("sampling", SAMPLINGS[1:], ids=["t1.5", "t0.8-topk-penalty"])
def test_sampler_logprobs_are_the_filtered_softmax_of_an_unpadded_forward(model, tokenizer, prompts, stops, sampling):
    completions = _backend(model, tokenizer, stops).generate(prompts, 4, sampling, seed=[5, 6, 7])
    for completion in completions:
        prompt = prompts[completion.prompt_index]
        ids = torch.tensor([prompt + completion.token_ids])
        with torch.no_grad():
            logits = model(input_ids=ids).logits[0, len(prompt) - 1 : -1].double()
        expected = []
        for step, token in enumerate(completion.token_ids):
            scores = logits[step].clone()
            if sampling.repetition_penalty != 1.0:  # the penalty as defined by CTRL: divide positive, multiply negative
                seen = torch.tensor(sorted(set(prompt + completion.token_ids[:step])))
                scores[seen] = torch.where(
                    scores[seen] > 0,
                    scores[seen] / sampling.repetition_penalty,
                    scores[seen] * sampling.repetition_penalty,
                )
            scores = scores / sampling.temperature
            if sampling.top_k:
                scores[scores < scores.topk(sampling.top_k).values[-1]] = -torch.inf
            expected.append(torch.log_softmax(scores, -1)[token])
        torch.testing.assert_close(
            torch.tensor(completion.logprobs, dtype=torch.float64), torch.stack(expected), rtol=0, atol=1e-4
        )


class ForwardLog:
    """Records the input_ids shape of every forward call of a model."""

    def __init__(self, model):
        self.shapes = []
        self.handle = model.register_forward_pre_hook(self.record, with_kwargs=True)

    def record(self, module, args, kwargs):
        self.shapes.append(tuple(kwargs["input_ids"].shape))


def test_each_prompt_is_prefilled_once_and_finished_rows_leave_the_batch(model, tokenizer, prompts, stops):
    sampling = SamplingParams(max_tokens=12, temperature=1.5)
    width = max(len(p) for p in prompts)
    runs = {}
    for share in (True, False):
        log = ForwardLog(model)
        try:
            runs[share] = _backend(model, tokenizer, stops, share_prefill=share).generate(prompts, 4, sampling, seed=9)
        finally:
            log.handle.remove()
        runs[share, "shapes"] = log.shapes
    assert runs[True, "shapes"][0] == (3, width)  # one row per distinct prompt
    assert runs[False, "shapes"][0] == (12, width)  # one row per completion
    lengths = [len(c.token_ids) for c in runs[True]]
    # After step s (1-based) the rows still running are the completions longer than s; each decode forward has
    # exactly those rows, one token each, and decoding stops with the longest.
    expected = [(sum(length > s for length in lengths), 1) for s in range(1, max(lengths))]
    assert runs[True, "shapes"][1:] == expected == runs[False, "shapes"][1:]
    assert sum(rows for rows, _ in expected) < 12 * len(expected)  # rows ended at different steps: fewer rows ran


def test_suppressed_tokens_are_never_sampled_in_either_path(model, tokenizer, prompts, stops):
    banned = list(range(30, 300))
    sampling = SamplingParams(max_tokens=8, temperature=2.0)
    backend = _backend(model, tokenizer, stops)
    seeds = completion_seeds(4, 3, 2)
    fast = backend.generate(prompts, 2, sampling, seed=4, suppress_tokens=banned)
    assert not {t for c in fast for t in c.token_ids} & set(banned)
    slow = backend.generate_with_transformers(model, prompts, 2, sampling, seeds, suppress_tokens=banned)
    assert [c.token_ids for c in fast] == [c.token_ids for c in slow]
    assert slow[0].logprobs is None  # generate reports no log-probs


def test_generation_kwargs_and_static_caches_go_through_generate(model, tokenizer, prompts, stops, monkeypatch):
    calls = []
    generate = model.generate
    monkeypatch.setattr(model, "generate", lambda *a, **k: calls.append(1) or generate(*a, **k))
    backend = _backend(model, tokenizer, stops)
    backend.generate(prompts, 2, SamplingParams(max_tokens=3), seed=1)
    assert calls == []
    backend.generate(prompts, 2, SamplingParams(max_tokens=3, extra={"no_repeat_ngram_size": 2}), seed=1)
    assert calls == [1]
    _backend(model, tokenizer, stops, cache_implementation="static").generate(prompts, 2, SamplingParams(max_tokens=3))
    assert calls == [1, 1]


def test_eager_attention_builds_its_own_masks(tiny_model_path, tokenizer, prompts, stops):
    """Only SDPA gets the decode step's mask ready-made; eager attention goes through transformers' masks."""
    eager = AutoModelForCausalLM.from_pretrained(tiny_model_path, attn_implementation="eager").eval()
    assert eager.config._attn_implementation == "eager"
    sampling = SamplingParams(max_tokens=10, temperature=1.5)
    reference = TransformersBackend(eager, tokenizer.pad_token_id, stops).generate_with_transformers(
        eager, prompts, 3, sampling, completion_seeds(2, 3, 3)
    )
    completions = _backend(eager, tokenizer, stops).generate(prompts, 3, sampling, seed=2)
    assert [c.token_ids for c in completions] == [c.token_ids for c in reference]


@pytest.mark.parametrize("budget", [1, 3 * 4 * 385 * 5, 1 << 30], ids=["per-step", "3-steps", "all"])
def test_step_noise_draws_what_gumbel_noise_draws_step_by_step(budget):
    """The decode loop draws several steps of each row's uniforms at once on the CPU: bitwise the per-step noise,
    while rows leave the batch (a vocabulary of 385, which no vector width divides)."""
    from posttrain.generation.transformers_backend import StepNoise, gumbel_noise

    seeds = [11, 12, 13, 14, 15]
    noise = StepNoise(
        [torch.Generator().manual_seed(s) for s in seeds], 385, torch.device("cpu"), 10, budget_bytes=budget
    )
    reference = [torch.Generator().manual_seed(s) for s in seeds]
    rows = [0, 1, 2, 3, 4]
    for step in range(10):
        assert torch.equal(noise(rows, step), gumbel_noise([reference[i] for i in rows], 385, "cpu"))
        if step in (1, 4, 5):
            rows = rows[:1] + rows[2:]


@pytest.mark.parametrize("family", ["qwen3", "gemma3", "mistral", "phi3", "mixtral"])
def test_decode_samples_what_generate_samples_on_every_family(tokenizer, prompts, family):
    """Other families through the decode loop (and its fast forward), sliding-window caches included: 14 tokens
    after the prompts run past Gemma 3's and Mistral's window of 8."""
    from posttrain.generation.transformers_backend import rows_can_be_copied
    from posttrain.models.fused_layers import fuse_layers
    from posttrain.models.tiny import build_tiny_model

    model = build_tiny_model(tokenizer, seed=2, family=family).eval()
    fuse_layers(model)
    assert rows_can_be_copied(model)
    sampling = SamplingParams(max_tokens=14, temperature=1.2)
    seeds = completion_seeds([21, 22, 23], 3, 2)
    stops = [tokenizer.eos_token_id]
    reference = TransformersBackend(model, tokenizer.pad_token_id, stops).generate_with_transformers(
        model, prompts, 2, sampling, seeds
    )
    for variant in VARIANTS:
        completions = _backend(model, tokenizer, stops, **variant).generate(prompts, 2, sampling, seed=[21, 22, 23])
        assert [c.token_ids for c in completions] == [c.token_ids for c in reference], variant
