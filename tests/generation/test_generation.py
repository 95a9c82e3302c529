"""Generation backends: the seeded Gumbel sampler samples the filtered softmax exactly, completions are cut at
the first stop token, seeds make sampling reproducible and independent of the batch, filters hold."""

import math

import pytest
import torch
from datasets import Dataset
from transformers import AutoModelForCausalLM

from posttrain.errors import ConfigError
from posttrain.generation import (
    SamplingParams,
    TransformersBackend,
    completion_seeds,
    create_generation_backend,
    stop_token_ids,
)
from posttrain.generation.transformers_backend import SeededGumbelSampler


@pytest.fixture(scope="module")
def model(tiny_model_path):
    return AutoModelForCausalLM.from_pretrained(tiny_model_path).eval()


@pytest.fixture(scope="module")
def prompts(tokenizer):
    texts = ["what is one plus two", "hello", "the cat and the dog are in the tree"]
    return [tokenizer(t)["input_ids"] for t in texts]


def _backend(model, tokenizer, stops=None):
    return TransformersBackend(model, tokenizer.pad_token_id, stops or [tokenizer.eos_token_id])


@pytest.mark.parametrize(
    "setting, kwargs",
    [
        ("max_completion_length", {"max_tokens": 0}),
        ("temperature", {"temperature": 0.0}),
        ("top_p", {"top_p": 0.0}),
        ("top_p", {"top_p": 1.5}),
        ("top_k", {"top_k": -1}),
        ("min_p", {"min_p": 1.0}),
        ("repetition_penalty", {"repetition_penalty": 0.0}),
    ],
)
def test_sampling_params_reject_bad_values_naming_the_setting(setting, kwargs):
    with pytest.raises(ConfigError, match=rf"^{setting}="):
        SamplingParams(**{"max_tokens": 4, **kwargs})


def test_gumbel_sampler_draws_from_the_softmax_of_the_scores():
    scores = torch.tensor([1.0, 0.0, -1.0, 2.0, -math.inf])
    rows = 20000
    sampler = SeededGumbelSampler(range(rows), torch.device("cpu"))
    picks = sampler(None, scores.expand(rows, -1).clone()).argmax(-1)
    frequencies = torch.bincount(picks, minlength=5).double() / rows
    expected = torch.softmax(scores.double(), 0)
    assert frequencies[4] == 0  # a banned token is never drawn
    tolerance = 4.5 * torch.sqrt(expected * (1 - expected) / rows)
    assert torch.all((frequencies - expected).abs() <= tolerance), (frequencies, expected)


def test_completions_are_prompt_major_and_cut_after_the_first_stop_token(model, tokenizer, prompts):
    sampling = SamplingParams(max_tokens=10)
    free = _backend(model, tokenizer).generate(prompts, 2, sampling, seed=7)
    assert [c.prompt_index for c in free] == [0, 0, 1, 1, 2, 2]
    assert all(len(c.token_ids) == 10 and not c.finished_with_eos for c in free)  # the random model never stops

    stop = free[0].token_ids[3]  # make a token sampled early in the first completion a stop token
    stopped = _backend(model, tokenizer, [tokenizer.eos_token_id, stop]).generate(prompts, 2, sampling, seed=7)
    for reference, completion in zip(free, stopped):
        if stop in reference.token_ids:
            cut = reference.token_ids.index(stop) + 1
            assert completion.token_ids == reference.token_ids[:cut] and completion.finished_with_eos
        else:
            assert completion.token_ids == reference.token_ids and not completion.finished_with_eos
    assert len(stopped[0].token_ids) <= 4 and stopped[0].logprobs is None


def test_a_prompt_seed_gives_the_same_completions_whatever_else_is_in_the_batch(model, tokenizer, prompts):
    backend, sampling = _backend(model, tokenizer), SamplingParams(max_tokens=8, temperature=1.3)
    together = backend.generate(prompts, 3, sampling, seed=[11, 12, 13])
    alone = backend.generate(prompts[2:], 3, sampling, seed=[13])  # different padding, different batch
    assert [c.token_ids for c in together[6:]] == [c.token_ids for c in alone]
    assert len({tuple(c.token_ids) for c in together}) == 9  # the completions of a prompt differ
    again = backend.generate(prompts, 3, sampling, seed=[11, 12, 13])
    assert [c.token_ids for c in again] == [c.token_ids for c in together]
    other = backend.generate(prompts, 3, sampling, seed=[11, 12, 14])
    assert [c.token_ids for c in other[:6]] == [c.token_ids for c in together[:6]]
    assert [c.token_ids for c in other[6:]] != [c.token_ids for c in together[6:]]


def test_without_a_seed_sampling_follows_torch_global_seed(model, tokenizer, prompts):
    backend, sampling = _backend(model, tokenizer), SamplingParams(max_tokens=6)
    torch.manual_seed(3)
    first = backend.generate(prompts, 2, sampling)
    torch.manual_seed(3)
    assert [c.token_ids for c in backend.generate(prompts, 2, sampling)] == [c.token_ids for c in first]


def _step_logits(model, prompt, completion):
    """Next-token logits [len(completion), V] at every completion position, from one unpadded forward."""
    ids = torch.tensor([prompt + completion])
    with torch.no_grad():
        return model(input_ids=ids).logits[0, len(prompt) - 1 : -1]


@pytest.mark.parametrize(
    "sampling, allowed",
    [
        (SamplingParams(max_tokens=6, top_k=1), lambda logits: logits == logits.max()),
        (SamplingParams(max_tokens=6, top_k=3), lambda logits: logits >= logits.topk(3).values[-1]),
        (
            SamplingParams(max_tokens=6, min_p=0.5, temperature=0.5),
            lambda logits: torch.softmax(logits / 0.5, -1) >= 0.5 * torch.softmax(logits / 0.5, -1).max(),
        ),
        (SamplingParams(max_tokens=6, top_p=0.05), lambda logits: _nucleus(torch.softmax(logits, -1), 0.05)),
    ],
)
def test_every_sampled_token_passes_the_filters(model, tokenizer, prompts, sampling, allowed):
    completions = _backend(model, tokenizer).generate(prompts, 3, sampling, seed=5)
    for completion in completions:
        logits = _step_logits(model, prompts[completion.prompt_index], completion.token_ids)
        for step, token in enumerate(completion.token_ids):
            assert allowed(logits[step])[token], (step, token)


def _nucleus(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """The smallest set of most likely tokens whose probabilities reach top_p."""
    order = probs.argsort(descending=True)
    before = torch.cumsum(probs[order], 0) - probs[order]
    keep = torch.zeros_like(probs, dtype=torch.bool)
    keep[order[before < top_p]] = True
    return keep


def test_top_k_1_is_greedy_decoding(model, tokenizer, prompts):
    completions = _backend(model, tokenizer).generate(prompts, 1, SamplingParams(max_tokens=7, top_k=1), seed=0)
    for prompt, completion in zip(prompts, completions):
        greedy = model.generate(
            torch.tensor([prompt]), max_new_tokens=7, do_sample=False, pad_token_id=tokenizer.pad_token_id
        )
        assert completion.token_ids == greedy[0, len(prompt) :].tolist()


def test_generation_runs_in_eval_mode_and_restores_train_mode(tiny_model_path, tokenizer, prompts):
    noisy = AutoModelForCausalLM.from_pretrained(tiny_model_path, attention_dropout=0.9).train()
    backend, sampling = _backend(noisy, tokenizer), SamplingParams(max_tokens=8)
    first = backend.generate(prompts, 2, sampling, seed=1)
    assert noisy.training
    # With dropout active (train mode) the same seeds would give different completions.
    assert [c.token_ids for c in backend.generate(prompts, 2, sampling, seed=1)] == [c.token_ids for c in first]


def test_a_peft_model_generates_through_its_adapter(tiny_model_path, tokenizer, prompts, model):
    from peft import LoraConfig, get_peft_model

    base = AutoModelForCausalLM.from_pretrained(tiny_model_path)
    peft_model = get_peft_model(base, LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    sampling = SamplingParams(max_tokens=6)
    reference = [c.token_ids for c in _backend(model, tokenizer).generate(prompts, 2, sampling, seed=2)]
    # LoRA starts as a no-op: the same completions as the base model.
    assert [c.token_ids for c in _backend(peft_model, tokenizer).generate(prompts, 2, sampling, seed=2)] == reference
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_B" in name:
                param.fill_(3.0)
    changed = [c.token_ids for c in _backend(peft_model, tokenizer).generate(prompts, 2, sampling, seed=2)]
    assert changed != reference


def test_completion_seeds_and_stop_tokens(tokenizer, tiny_model_path):
    per_prompt = completion_seeds([5, 6], 2, 3)
    assert len(set(per_prompt)) == 6
    assert completion_seeds([6], 1, 3) == per_prompt[3:]  # a prompt's seeds depend only on its own seed
    assert completion_seeds(None, 2, 3) is None
    assert completion_seeds(9, 2, 3) == completion_seeds(9, 2, 3) != completion_seeds(10, 2, 3)
    with pytest.raises(ConfigError, match="2 seeds for 3 prompts"):
        completion_seeds([1, 2], 3, 1)

    model = AutoModelForCausalLM.from_pretrained(tiny_model_path)
    model.generation_config.eos_token_id = [tokenizer.eos_token_id, 7]
    assert stop_token_ids(tokenizer, model) == [tokenizer.eos_token_id, 7]
    backend = create_generation_backend(model, tokenizer, None)
    assert isinstance(backend, TransformersBackend) and backend.eos_token_ids == [tokenizer.eos_token_id, 7]


def test_generation_kwargs_reach_generate(model, tokenizer, prompts):
    allowed = [tokenizer.eos_token_id, 11, 12, 13]
    suppressed = [t for t in range(model.config.vocab_size) if t not in allowed]
    sampling = SamplingParams(max_tokens=6, extra={"suppress_tokens": suppressed})
    completions = _backend(model, tokenizer).generate(prompts, 3, sampling, seed=4)
    assert {t for c in completions for t in c.token_ids} <= set(allowed)
    plain = _backend(model, tokenizer).generate(prompts, 3, SamplingParams(max_tokens=6), seed=4)
    assert not {t for c in plain for t in c.token_ids} <= set(allowed)  # without it other tokens come up
    with pytest.raises(ConfigError, match=r"GenerationConfig does not know: \['presence_penalty'\]"):
        _backend(model, tokenizer).generate(prompts, 1, SamplingParams(max_tokens=2, extra={"presence_penalty": 1}))


def test_cache_implementation_and_generation_kwargs_build_the_generation_config():
    from posttrain.generation.transformers_backend import generation_config

    config = generation_config(
        SamplingParams(max_tokens=5, repetition_penalty=1.3, extra={"no_repeat_ngram_size": 2}),
        [2, 7],
        0,
        cache_implementation="static",
    )
    assert (config.cache_implementation, config.no_repeat_ngram_size, config.max_new_tokens) == ("static", 2, 5)
    assert (config.do_sample, config.num_beams, config.eos_token_id, config.repetition_penalty) == (
        False,
        1,
        [2, 7],
        1.3,
    )
    assert generation_config(SamplingParams(max_tokens=5), [2], 0).cache_implementation is None


def test_a_trainer_config_reaches_the_backend(model, tokenizer):
    from posttrain.trainers.grpo import GRPOConfig

    args = GRPOConfig(
        output_dir="unused",
        use_cpu=True,
        bf16=False,
        cache_implementation="dynamic",
        generation_kwargs='{"no_repeat_ngram_size": 3}',
        per_device_train_batch_size=8,
    )
    backend = create_generation_backend(model, tokenizer, args)
    assert backend.cache_implementation == "dynamic"
    assert args.sampling_params().extra == {"no_repeat_ngram_size": 3} and args.sampling_params().min_p == 0.0


def test_continuous_batching_request_order_is_prompt_major():
    from posttrain.generation.continuous_batching import request_order

    assert request_order(["req_1", "req_0__child#0", "req_0", "req_1__child#0"], 2, 2) == [
        "req_0",
        "req_0__child#0",
        "req_1",
        "req_1__child#0",
    ]
    with pytest.raises(RuntimeError, match=r"no result for the requests \['req_1'\]"):
        request_order(["req_0"], 2, 1)


@pytest.mark.slow
def test_continuous_batching_generates_reproducible_prompt_major_completions(model, tokenizer, prompts):
    from posttrain.generation.continuous_batching import ContinuousBatchingBackend

    backend = ContinuousBatchingBackend(model, tokenizer.pad_token_id, [tokenizer.eos_token_id, 11])
    sampling = SamplingParams(max_tokens=4, top_k=3)
    completions = backend.generate(prompts[:2], 2, sampling, seed=[1, 2])
    assert [c.prompt_index for c in completions] == [0, 0, 1, 1]
    assert [c.token_ids for c in backend.generate(prompts[:2], 2, sampling, seed=[1, 2])] == [
        c.token_ids for c in completions
    ]
    for completion in completions:
        logits = _step_logits(model, prompts[completion.prompt_index], completion.token_ids)
        for step, token in enumerate(completion.token_ids):
            assert logits[step][token] >= logits[step].topk(3).values[-1]
        assert completion.finished_with_eos == (completion.token_ids[-1] in (tokenizer.eos_token_id, 11))


def test_colocated_vllm_on_a_cpu_refuses_heads_below_32_dimensions(tmp_path, tiny_model_path):
    """vLLM's CPU attention needs head_dim >= 32: the tiny model (32 / 4 heads = 8) is refused when the trainer is
    built, before vLLM is imported."""
    import torch

    from posttrain import GRPOConfig, GRPOTrainer
    from posttrain.errors import ConfigError

    if torch.cuda.is_available():
        pytest.skip("the limit is the CPU backend's")
    args = GRPOConfig(
        output_dir=str(tmp_path),
        use_vllm=True,
        vllm_mode="colocate",
        per_device_train_batch_size=4,
        num_generations=4,
        max_completion_length=8,
        report_to="none",
        use_cpu=True,
        bf16=False,
    )
    prompts = Dataset.from_list([{"prompt": "one two"}] * 4)
    with pytest.raises(ConfigError, match=r"at least 32 dimensions, but this model's are 8 \(hidden_size 32 / 4"):
        GRPOTrainer(
            tiny_model_path, lambda completions, **kw: [0.0] * len(completions), args=args, train_dataset=prompts
        )
