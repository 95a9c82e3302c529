"""Multi-turn tool episodes on vLLM colocate (server mode: test_vllm_server.py): greedy episodes give the same
token ids as on the transformers backend, continuing each turn from the ids so far (prompt + sampled turns + tool
turns).

A random tiny model never writes a tool call or ends a turn by itself, so the episode is made multi-turn from
plain greedy sampling: a parser reads every finished turn as one call of `echo`, and a token the model emits
greedily early on serves as an extra stop id (on both backends alike).
"""

from __future__ import annotations

import pytest

from posttrain.generation import TransformersBackend
from posttrain.tools import use_chatml_tool_template

from _vllm_reference import PROMPTS, perturbed_model, reference_greedy, tool_episodes

pytestmark = pytest.mark.vllm


def test_greedy_tool_episode_is_identical_on_transformers_and_vllm_colocate(vllm_tiny_untied_path):
    pytest.importorskip("vllm")
    from transformers import AutoTokenizer

    from posttrain.generation.vllm_backend import VLLMColocateBackend

    model = perturbed_model(vllm_tiny_untied_path, seed=7)
    tokenizer = use_chatml_tool_template(AutoTokenizer.from_pretrained(vllm_tiny_untied_path), default_system=None)
    greedy, gap = reference_greedy(model, PROMPTS[0], 6)
    assert gap > 1e-3, "near-tie in the greedy reference: pick another seed"
    stop_ids = [tokenizer.eos_token_id, greedy[3]]  # the first turn of prompt 0 ends after 4 tokens
    local, local_rollouts = tool_episodes(TransformersBackend(model, tokenizer.pad_token_id, stop_ids), tokenizer)
    vllm_backend = VLLMColocateBackend(model, tokenizer, stop_ids, max_model_len=256, kv_cache_gb=0.25)
    remote, _ = tool_episodes(vllm_backend, tokenizer)

    assert local[0].token_ids[:4] == greedy[:4] and local[0].info["turns"] >= 2  # a real multi-turn episode
    assert local_rollouts.stats.calls >= 1 and 0 in local[0].model_mask  # tool-turn tokens are in the episode
    for mine, theirs in zip(local, remote):
        assert theirs.token_ids == mine.token_ids
        assert theirs.model_mask == mine.model_mask
        assert theirs.info == mine.info
        assert theirs.finished == mine.finished
