"""Multi-turn tool episodes on vLLM colocate (server mode: test_vllm_server.py): greedy episodes give the same
token ids as on the transformers backend, continuing each turn from the ids so far (prompt + sampled turns + tool
turns).

A random tiny model never writes a tool call or ends a turn by itself, so the episode is made multi-turn from
plain greedy sampling: a parser reads every finished turn as one call of `echo`, and a token the model emits
greedily early on serves as an extra stop id (on both backends alike).
"""

from __future__ import annotations

import pytest
from _vllm_reference import assert_same_episodes, tool_episodes, transformers_tool_episodes

pytestmark = pytest.mark.vllm


def test_greedy_tool_episode_is_identical_on_transformers_and_vllm_colocate(vllm_tiny_untied_path):
    pytest.importorskip("vllm")
    from posttrain.generation.vllm_backend import VLLMColocateBackend

    model, tokenizer, stop_ids, expected = transformers_tool_episodes(vllm_tiny_untied_path, seed=7)
    backend = VLLMColocateBackend(model, tokenizer, stop_ids, max_model_len=256, kv_cache_gb=0.25)
    assert_same_episodes(expected, tool_episodes(backend, tokenizer)[0])
