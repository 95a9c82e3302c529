"""Generation with the training model itself (transformers, KV cache, left padding).

Sampling uses the Gumbel-max trick with one random stream per completion: after the repetition penalty,
temperature, top-k, top-p and min-p filters, each row adds Gumbel noise drawn from its own seeded
generator and takes the arg-max, which is an exact sample from the filtered softmax. Because no row
draws from a shared random state, a completion depends only on its prompt, its seed and the weights,
not on which other prompts are in the batch or on which process it is generated.

Decoding runs in this module's own loop (`decode`) rather than `model.generate`, for two savings that
`generate` cannot make: each distinct prompt is prefilled once and its KV cache is copied to the group's
`n` completions (GRPO's prompts are repeated `num_generations` times, so `generate` would prefill each
one n times), and a row that has sampled a stop token leaves the batch, so finished completions stop
costing compute (`generate` keeps decoding them as padding until the last row ends). What the loop does
not handle (images, `generation_kwargs`, a non-dynamic cache, models whose cache cannot be copied by
rows) goes through `model.generate` with the same sampler, which samples the same tokens.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence

import torch
from accelerate.utils import extract_model_from_parallel
from transformers import (
    DynamicCache,
    GenerationConfig,
    LogitsProcessor,
    LogitsProcessorList,
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)
from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer

from posttrain.errors import ConfigError
from posttrain.generation.base import Completion, GenerationBackend, SamplingParams, completion_seeds, derive_seed
from posttrain.generation.decode_cache import reserve
from posttrain.models.fast_forward import fast_forward


def gumbel_noise(generators: Sequence[torch.Generator], vocab_size: int, device: torch.device) -> torch.Tensor:
    """[len(generators), vocab_size] Gumbel(0, 1) noise, row i from generators[i]."""
    return _gumbel(
        torch.stack([torch.rand(vocab_size, generator=g, device=device, dtype=torch.float32) for g in generators])
    )


def _gumbel(uniform: torch.Tensor) -> torch.Tensor:
    tiny = torch.finfo(torch.float32).tiny
    return -torch.log((-torch.log(uniform.clamp(min=tiny))).clamp(min=tiny))


class StepNoise:
    """The decode loop's Gumbel noise: `noise(rows, step)` is [len(rows), vocab_size], row i from generators[rows[i]],
    bitwise what `gumbel_noise` gives step by step. On the CPU a generator's stream does not depend on how its draws
    are split into calls, so each row draws the uniforms of several steps at once (up to `budget_bytes` for all
    rows): one call per row every few steps instead of one per row and step; each step's [rows, vocab] block is then
    transformed on its own, as `gumbel_noise` does. Elsewhere (CUDA's Philox offsets advance per call) every step
    draws on its own."""

    def __init__(
        self,
        generators: Sequence[torch.Generator],
        vocab_size: int,
        device: torch.device,
        max_steps: int,
        budget_bytes: int = 32 << 20,
    ) -> None:
        self.generators, self.vocab_size, self.device = generators, vocab_size, device
        per_step = 4 * vocab_size * max(len(generators), 1)
        self.steps = max(1, min(max_steps, budget_bytes // per_step)) if torch.device(device).type == "cpu" else 1
        self.block: torch.Tensor | None = None  # uniforms [rows drawn for, steps, vocab]
        self.block_rows: list[int] = []
        self.block_start = 0

    def __call__(self, rows: list[int], step: int) -> torch.Tensor:
        """A fresh tensor (the sampler adds the scores to it in place)."""
        if self.steps == 1:
            return gumbel_noise([self.generators[i] for i in rows], self.vocab_size, self.device)
        if self.block is None or step >= self.block_start + self.steps:
            shape = (len(rows), self.steps, self.vocab_size)
            if self.block is None or self.block.shape != shape:
                self.block = torch.empty(shape, device=self.device, dtype=torch.float32)
            for i, row in enumerate(rows):  # drawn straight into the block: no stacking copy
                torch.rand(self.steps, self.vocab_size, generator=self.generators[row], out=self.block[i])
            self.block_rows, self.block_start = list(rows), step
        offset = step - self.block_start
        if rows == self.block_rows:
            return _gumbel_in_place(self.block[:, offset].clone(memory_format=torch.contiguous_format))
        position = {row: i for i, row in enumerate(self.block_rows)}
        return _gumbel_in_place(self.block[[position[row] for row in rows], offset])


def _gumbel_in_place(uniform: torch.Tensor) -> torch.Tensor:
    """`_gumbel` computed in `uniform`'s own memory: the same operations on the same values (bitwise the same
    noise), without five fresh [rows, vocab] tensors a step."""
    tiny = torch.finfo(torch.float32).tiny
    return uniform.clamp_(min=tiny).log_().neg_().clamp_(min=tiny).log_().neg_()


class SeededGumbelSampler(LogitsProcessor):
    """Adds Gumbel(0, 1) noise to each row's scores from that row's own generator; greedy decoding on the
    result samples from softmax(scores)."""

    def __init__(self, seeds: Sequence[int], device: torch.device) -> None:
        self.generators = [torch.Generator(device=device).manual_seed(seed) for seed in seeds]

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        return scores.float() + gumbel_noise(self.generators, scores.shape[-1], scores.device)


def _filters(sampling: SamplingParams) -> list[LogitsProcessor]:
    filters: list[LogitsProcessor] = []
    if sampling.temperature != 1.0:
        filters.append(TemperatureLogitsWarper(sampling.temperature))
    if sampling.top_k > 0:
        filters.append(TopKLogitsWarper(sampling.top_k))
    if sampling.top_p < 1.0:
        filters.append(TopPLogitsWarper(sampling.top_p))
    if sampling.min_p > 0:
        filters.append(MinPLogitsWarper(sampling.min_p))
    return filters


def generation_config(
    sampling: SamplingParams, eos_token_ids: Sequence[int], pad_token_id: int, **settings
) -> GenerationConfig:
    """Greedy decoding over the filtered, Gumbel-noised scores, plus `sampling.extra` (generation_kwargs),
    each key of which must be a GenerationConfig setting (an unknown one would be ignored without a word)."""
    known = GenerationConfig().to_dict()
    unknown = sorted(set(sampling.extra) - set(known))
    if unknown:
        raise ConfigError(
            f"generation_kwargs has keys that transformers' GenerationConfig does not know: {unknown}. "
            "Fix their spelling or drop them (vLLM-only settings need use_vllm=True)."
        )
    return GenerationConfig(
        **{
            **sampling.extra,
            "max_new_tokens": sampling.max_tokens,
            "do_sample": False,
            "num_beams": 1,
            "repetition_penalty": sampling.repetition_penalty,
            "eos_token_id": list(eos_token_ids),
            "pad_token_id": pad_token_id,
            **{k: v for k, v in settings.items() if v is not None},
        }
    )


def left_pad(rows: Sequence[Sequence[int]], pad_token_id: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """input_ids and attention_mask of `rows` left-padded to the longest."""
    width = max(len(r) for r in rows)
    input_ids = torch.tensor([[pad_token_id] * (width - len(r)) + list(r) for r in rows], device=device)
    attention_mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows], device=device)
    return input_ids, attention_mask


class _ModelCall:
    """The model's forward as the decode loop calls it: the last position's logits in float32."""

    def __init__(self, model) -> None:
        self.model = model
        # An MoE model set to return router logits would also compute its aux loss on every step: not for sampling.
        self.quiet = {"output_router_logits": False} if getattr(model.config, "output_router_logits", False) else {}
        # Without transformers' per-module wrappers where the model allows: the same logits (models/fast_forward.py).
        self.fast = fast_forward(model)
        # A decode step's query sees every unpadded position: with SDPA that mask is given ready-made, which
        # spares transformers building it from the 2D mask at every step (not with sliding-window layers, whose
        # cache keeps only the window's keys; known once the prefill has made the cache).
        self.sdpa = model.config._attn_implementation == "sdpa"
        self.ready_mask = False

    def prefill(self, input_ids, attention_mask, position_ids, cache) -> torch.Tensor:
        logits = self._prefill(input_ids, attention_mask, position_ids, cache)
        self.ready_mask = self.sdpa and not any(layer.is_sliding for layer in cache.layers)
        return logits

    def _prefill(self, input_ids, attention_mask, position_ids, cache) -> torch.Tensor:
        if self.fast is not None:
            return self.fast(input_ids, attention_mask, position_ids, cache, logits_to_keep=1)[:, -1].float()
        return (
            self.model(
                input_ids=input_ids,
                attention_mask=attention_mask,
                position_ids=position_ids,
                cache=cache,
                use_cache=True,
                logits_to_keep=1,
                **self.quiet,
            )
            .logits[:, -1]
            .float()
        )

    def step(self, tokens, attention_mask, positions, cache) -> torch.Tensor:
        """One new token per row: `tokens` [rows], `attention_mask` [rows, width] including them."""
        step_mask = attention_mask[:, None, None, :].bool() if self.ready_mask else attention_mask
        if self.fast is not None:
            return self.fast(tokens[:, None], step_mask, positions[:, None], cache)[:, -1].float()
        return (
            self.model(
                input_ids=tokens[:, None],
                attention_mask=step_mask,
                position_ids=positions[:, None],
                cache=cache,
                use_cache=True,
                **self.quiet,
            )
            .logits[:, -1]
            .float()
        )


class _StepSampler:
    """A decode step's tokens from its logits: the repetition penalty, suppressed tokens and filters, then the
    arg-max with each completion's own Gumbel noise (`StepNoise`), or without it when top_k=1."""

    def __init__(self, sampling: SamplingParams, seeds, vocab_size, rows, pad_token_id, device, suppress_tokens):
        generators = [torch.Generator(device=device).manual_seed(s) for s in seeds]
        self.noise = StepNoise(generators, vocab_size, device, sampling.max_tokens)
        self.penalty = (
            RepetitionPenaltyLogitsProcessor(sampling.repetition_penalty)
            if sampling.repetition_penalty != 1.0
            else None
        )
        # The completions so far, which the penalty reads (with the padded prompt, as generate does).
        self.generated = (
            None
            if self.penalty is None
            else torch.full((rows, sampling.max_tokens), pad_token_id, dtype=torch.long, device=device)
        )
        self.suppressed = list(suppress_tokens) if suppress_tokens else None
        self.filters = _filters(sampling)
        self.greedy = sampling.top_k == 1  # the noise would only break exact ties

    def __call__(self, logits, input_ids, active, active_rows: list[int], step: int):
        """(tokens [rows], the filtered scores they were sampled from) for the completions `active_rows`."""
        scores = logits
        if self.penalty is not None:
            scores = self.penalty(torch.cat([input_ids[active], self.generated[active, :step]], dim=1), scores)
        if self.suppressed:
            scores[:, self.suppressed] = -float("inf")
        for apply in self.filters:
            scores = apply(None, scores)
        # noise + scores (in the noise's memory) is bitwise scores + noise: float addition commutes.
        tokens = scores.argmax(-1) if self.greedy else self.noise(active_rows, step).add_(scores).argmax(-1)
        if self.generated is not None:
            self.generated[active, step] = tokens
        return tokens, scores


class _GrowingCompletions:
    """Each completion's tokens up to and including its stop token, the sampler's log-probs of them when asked
    for, and whether it has stopped."""

    def __init__(self, rows: int, stop_tokens: Sequence[int], with_logprobs: bool) -> None:
        self.tokens: list[list[int]] = [[] for _ in range(rows)]
        self.logprobs: list[list[float]] | None = [[] for _ in range(rows)] if with_logprobs else None
        self.finished = [False] * rows
        self.stops = set(stop_tokens)

    def append(self, active_rows: list[int], tokens: torch.Tensor, scores: torch.Tensor) -> list[bool]:
        """Adds a step's tokens of the completions `active_rows`; returns which of them go on."""
        sampled = tokens.tolist()
        logprobs = (
            scores.log_softmax(-1).gather(1, tokens[:, None])[:, 0].tolist() if self.logprobs is not None else None
        )
        keep = []
        # Locals: this loop runs once per token.
        completions, logprob_lists, finished, stops = self.tokens, self.logprobs, self.finished, self.stops
        for i, (row, token) in enumerate(zip(active_rows, sampled)):
            if not finished[row]:  # (with drop_finished off a finished row samples on, as padding)
                completions[row].append(token)
                if logprobs is not None:
                    logprob_lists[row].append(logprobs[i])
                finished[row] = token in stops
            keep.append(not finished[row])
        return keep

    def completions(self, n: int) -> list[Completion]:
        return [
            Completion(i // n, tokens, self.logprobs[i] if self.logprobs is not None else None, self.finished[i])
            for i, tokens in enumerate(self.tokens)
        ]


class TransformersBackend(GenerationBackend):
    """Generates with `model` (the trainer's model object, so it always has the current weights), in eval mode
    without gradients; the model's train/eval mode is restored afterwards.

    `share_prefill=False` prefills every completion's copy of its prompt and `drop_finished=False` keeps
    finished rows in the batch (both as `generate` does): the same completions, slower; they exist to measure
    each saving. `return_logprobs` reports the sampler's log-probabilities of the sampled tokens (log-softmax of
    the filtered scores, as vLLM's processed log-probs); the `generate` fallback reports none.
    """

    # The decode loop's cache grows in place by this many positions at a time (decode_cache.py); None: by
    # concatenation at every step, as transformers' DynamicCache does (the same tokens, slower).
    reserve_chunk: int | None = 256

    def __init__(
        self,
        model,
        pad_token_id: int,
        eos_token_ids: Sequence[int],
        cache_implementation: str | None = None,
        share_prefill: bool = True,
        drop_finished: bool = True,
        return_logprobs: bool = False,
    ) -> None:
        self.model = model
        self.pad_token_id = pad_token_id
        self.eos_token_ids = list(eos_token_ids)
        self.cache_implementation = cache_implementation
        self.share_prefill = share_prefill
        self.drop_finished = drop_finished
        self.return_logprobs = return_logprobs
        self._unwrapped: tuple | None = None  # (self.model, the model to call, whether `decode` can run it)
        # Called with the step number before the forward that gives `decode` step's logits (step >= 1): a
        # generation process swaps in newer weights there (online/producers/generation_worker.py).
        self.before_decode_step: Callable[[int], None] | None = None

    def unwrapped(self):
        """The model to call (DDP/compile wrappers off; a PEFT model stays as is) and whether `decode` can run it,
        worked out once per model object: accelerate's unwrapping looks up installed packages on every call."""
        if self._unwrapped is None or self._unwrapped[0] is not self.model:
            model = extract_model_from_parallel(self.model)
            self._unwrapped = (self.model, model, rows_can_be_copied(model))
        return self._unwrapped[1:]

    @torch.no_grad()
    def generate(
        self,
        prompt_ids: Sequence[Sequence[int]],
        n: int,
        sampling: SamplingParams,
        seed: int | Sequence[int] | None = None,
        vision: Sequence[dict] | None = None,
        suppress_tokens: Sequence[int] | None = None,
    ) -> list[Completion]:
        """`vision`: per prompt, its image inputs (`split_vision_inputs`, with unpadded per-token inputs), which
        every completion of the prompt is generated with; `suppress_tokens` are never sampled (image tokens)."""
        model, decodable = self.unwrapped()
        seeds = completion_seeds(seed, len(prompt_ids), n)
        if seeds is None:  # fresh randomness, drawn from the global generator (which seeding reproduces)
            seeds = [derive_seed(int(torch.randint(2**62, ()))) for _ in range(len(prompt_ids) * n)]
        was_training = model.training
        model.eval()
        try:
            if vision is None and not sampling.extra and self.cache_implementation in (None, "dynamic") and decodable:
                return self.decode(model, prompt_ids, n, sampling, seeds, suppress_tokens)
            return self.generate_with_transformers(model, prompt_ids, n, sampling, seeds, vision, suppress_tokens)
        finally:
            model.train(was_training)

    def decode(
        self,
        model,
        prompt_ids: Sequence[Sequence[int]],
        n: int,
        sampling: SamplingParams,
        seeds: list[int],
        suppress_tokens: Sequence[int] | None = None,
    ) -> list[Completion]:
        """Prefill (each distinct prompt once, unless share_prefill is off), then one token per step for the rows
        still running."""
        device = next(model.parameters()).device
        call = _ModelCall(model)
        copies = 1 if self.share_prefill else n
        input_ids, attention_mask = left_pad([p for p in prompt_ids for _ in range(copies)], self.pad_token_id, device)
        position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
        cache = DynamicCache(config=model.config)
        logits = call.prefill(input_ids, attention_mask, position_ids, cache)
        if copies != n:  # the group's n completions continue from one prompt's cache
            cache.batch_repeat_interleave(n)
            logits, input_ids, attention_mask, position_ids = (
                t.repeat_interleave(n, dim=0) for t in (logits, input_ids, attention_mask, position_ids)
            )
        if self.reserve_chunk is not None:
            reserve(cache, self.reserve_chunk, input_ids.shape[1] + sampling.max_tokens)

        rows = input_ids.shape[0]
        active = torch.arange(rows, device=device)  # which completion each batch row is
        active_rows = list(range(rows))  # the same, as a list: the per-row bookkeeping is done in Python
        sampler = _StepSampler(sampling, seeds, logits.shape[-1], rows, self.pad_token_id, device, suppress_tokens)
        grown = _GrowingCompletions(rows, self.eos_token_ids, self.return_logprobs)
        next_position = position_ids[:, -1] + 1
        for step in range(sampling.max_tokens):
            tokens, scores = sampler(logits, input_ids, active, active_rows, step)
            keep = grown.append(active_rows, tokens, scores)
            if step + 1 == sampling.max_tokens or not any(keep):
                break
            if self.drop_finished and not all(keep):
                index = torch.tensor([i for i, kept in enumerate(keep) if kept], device=device)
                cache.batch_select_indices(index)
                active, tokens, attention_mask, next_position = (
                    t[index] for t in (active, tokens, attention_mask, next_position)
                )
                active_rows = [row for row, kept in zip(active_rows, keep) if kept]
            if self.before_decode_step is not None:
                self.before_decode_step(step + 1)
            attention_mask = torch.cat([attention_mask, attention_mask.new_ones(len(active_rows), 1)], dim=1)
            logits = call.step(tokens, attention_mask, next_position, cache)
            next_position = next_position + 1
        return grown.completions(n)

    def generate_with_transformers(
        self,
        model,
        prompt_ids: Sequence[Sequence[int]],
        n: int,
        sampling: SamplingParams,
        seeds: list[int],
        vision: Sequence[dict] | None = None,
        suppress_tokens: Sequence[int] | None = None,
    ) -> list[Completion]:
        """All n * len(prompts) completions in one left-padded `model.generate` batch."""
        device = next(model.parameters()).device
        input_ids, attention_mask = left_pad([p for p in prompt_ids for _ in range(n)], self.pad_token_id, device)
        width = input_ids.shape[1]
        config = generation_config(
            sampling,
            self.eos_token_ids,
            self.pad_token_id,
            cache_implementation=self.cache_implementation,
            suppress_tokens=list(suppress_tokens) if suppress_tokens else None,
        )
        images = {}
        if vision is not None:
            from posttrain.data.vision import vision_batch

            dtype = next(model.parameters()).dtype
            images = {
                k: v.to(device, dtype) if k.startswith("pixel_values") else v.to(device)
                for k, v in vision_batch([part for part in vision for _ in range(n)], width).items()
            }
        processors = LogitsProcessorList([*_filters(sampling), SeededGumbelSampler(seeds, device)])
        output = model.generate(
            input_ids=input_ids,
            attention_mask=attention_mask,
            generation_config=config,
            logits_processor=processors,
            **images,
        )
        return [
            completion_from_tokens(i // n, generated, self.eos_token_ids)
            for i, generated in enumerate(output[:, width:].tolist())
        ]


def rows_can_be_copied(model) -> bool:
    """Whether `decode` can run `model`: a decoder whose cache is made of plain or sliding-window key/value layers
    (copied and selected by rows), and whose forward takes the cache as `cache`."""
    config = model.config
    base = model.get_base_model() if hasattr(model, "get_base_model") else model  # PEFT passes `cache` on
    if config.is_encoder_decoder or "cache" not in inspect.signature(base.forward).parameters:
        return False
    return all(type(layer) in (DynamicLayer, DynamicSlidingWindowLayer) for layer in DynamicCache(config=config).layers)


def completion_from_tokens(prompt_index: int, generated: list[int], eos_token_ids: Sequence[int]) -> Completion:
    """Keeps the tokens up to and including the first stop token (what follows is padding)."""
    for position, token in enumerate(generated):
        if token in eos_token_ids:
            return Completion(prompt_index, generated[: position + 1], None, True)
    return Completion(prompt_index, generated, None, False)
