"""TRL's `trl.generation.vllm_generation` names: the device cache helper and the log-probs of in-process vLLM
outputs. posttrain's in-process vLLM driver is `posttrain.generation.vllm_backend`."""

from __future__ import annotations

import math

from posttrain.runtime.device_cache import empty_cache


def extract_logprobs(all_outputs) -> tuple[list | None, list | None]:
    """(log-probs, token ids), each [sequence][position][candidate] with candidates by vLLM's rank (most probable
    first; a NaN log-prob is None), from vLLM `RequestOutput`s: one sequence per completion of each request.
    (None, None) when a completion carries no log-probs (sampled without `logprobs`)."""
    logps, ids = [], []
    for request in all_outputs:
        for completion in request.outputs:
            if completion.logprobs is None:
                return None, None
            ranked = [sorted(position.items(), key=lambda item: item[1].rank) for position in completion.logprobs]
            ids.append([[token for token, _ in position] for position in ranked])
            logps.append(
                [[None if math.isnan(lp.logprob) else lp.logprob for _, lp in position] for position in ranked]
            )
    return logps, ids


__all__ = ["empty_cache", "extract_logprobs"]
