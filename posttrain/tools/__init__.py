"""Tool-calling building blocks for agentic rollouts: schemas, template check, parsers, executor, environments.

Pure pieces (no trainer state) that the online engine composes: `schema` (tool descriptions and the template
check), `templates` (a ChatML tool template for SmolLM2-style tokenizers), `parsers` (calls out of text),
`executor` (run calls, never crash), `environment` (TRL's ``environment_factory=`` contract), `tokens` (the
ids of a tool turn, appended after the sampled ids).

What TRL 1.16's GRPOTrainer does (read from trl/trainer/grpo_trainer.py; the behaviour to match)
-------------------------------------------------------------------------------------------------
Set-up. ``tools=[callables]`` (sync or async) and/or ``environment_factory=`` require a template that renders
user -> assistant(tool_calls) -> tool with name, arguments and result visible (`supports_tool_calling`), else
ValueError. The tokenizer gets a response parser (`add_response_schema`) if it has none. If the template is not
prefix-preserving, a training template (`get_training_chat_template`) is used for every render below.

Prompts are rendered with ``apply_chat_template(prompt, tools=tools or None, add_generation_prompt=True,
tokenize=True)`` (with environments: per row, with that row's environment's tools). Each completion is parsed with
``tokenizer.parse_response(ids, prefix=prompt_ids, tools=...)``; a completion that does not parse (malformed or cut
call) is plain text: no call, the episode ends, nothing is counted.

The loop (`_tool_call_loop`), while some rollouts have calls and fewer than `max_tool_calling_iterations`
rounds ran (None: no limit):
1. Each call counts one in ``tool_call_count``. Sync tools run inline, in order; async ones are gathered
   concurrently (``return_exceptions=True``) on a daemon event loop. An exception, an unknown name ("Tool X not
   found.") or a non-"function" call counts one failure and its result is ``{"error": str(e)}``. There is no
   timeout and no argument validation. Messages ``{"role": "tool", "name": name, "content": str(result)}`` (a list
   result passes through as content blocks, for images) are appended, sync results first, then async ones.
2. Tokens: the tool turn's ids are a suffix computed by rendering a dummy ``[user, assistant calling
   <first tool's name> with {}]`` (no generation prompt), cut after its last EOS, and the same plus the tool
   messages with ``add_generation_prompt=True``; suffix = the second minus the first (ValueError if not a
   prefix). For ChatML that is ``"\\n<|im_start|>user\\n<tool_response>...</tool_response><|im_end|>\\n
   <|im_start|>assistant\\n"``: the newline after the model's EOS and the next assistant header belong to the
   suffix. The next input is ``prompt_ids + completion_ids + suffix`` -- the sampled ids are never decoded and
   re-encoded.
3. If ``len(completion + suffix) > max_completion_length`` or the whole sequence reaches the model's
   ``max_position_embeddings`` (vLLM colocate: ``max_model_len``), this round's tool messages are rolled back
   and that rollout leaves the loop with its completion as it was.
4. The continuation is sampled from those ids (one sample each) and cut so the completion stays within
   ``max_completion_length``. Then ``tool_mask += [0]*len(suffix) + [1]*len(continuation)``, sampler
   ``logprobs += [0.0]*len(suffix) + continuation_logprobs`` and ``completion_ids = (prompt+completion+suffix)
   [len(prompt):] + continuation``. The continuation is parsed again (prefix = the ids before it) for new calls.

Masks. ``tool_mask`` (1 = model token, 0 = tool token, right-padded with 1) multiplies ``completion_mask``
everywhere a token counts: the loss and its normaliser (``num_items_in_batch``), the KL term, the entropy
(top-entropy quantile), vLLM importance-sampling ratios and their metrics, the off-policy mask and
sequence-level ratios. ``mask_truncated_completions`` zeroes both masks of truncated rollouts (last id not EOS/pad).
Completion-length metrics count model tokens only (``sum(tool_mask)``). The reward functions get the
completion as the whole message list (assistant with ``tool_calls``, tool, ..., final assistant), and
``environments=[...]`` when environments are used.

Metrics: ``tools/call_frequency`` = calls (summed over processes) / rollouts; ``tools/failure_frequency`` =
failures / calls (0.0 without calls). Logged only when tools are present.

``rollout_func(prompts, trainer) -> dict``: replaces generation. `prompts` is a deep copy of the process's batch
of dataset prompts (messages not templated; environment observations already appended), one entry per rollout
(the sampler repeats each prompt `num_generations` times in a row). The dict must hold ``prompt_ids``,
``completion_ids`` and ``logprobs`` (per-rollout lists; ValueError names the missing keys); ``logprob_token_ids``
is optional; ``env_mask`` (per completion token, 1 = model, 0 = external) is popped and used as ``tool_mask``
when no tools are given; every other key is forwarded to the reward functions as a keyword argument. With
``tools=``, the tool loop above still runs on the rollout_func's output. Under vLLM, weights are synced first.

Where posttrain's pieces differ (for the engine to decide)
---------------------------------------------------------
- Unreadable calls (invalid / unterminated JSON) are `ParseError`s the engine can return to the model as an
  error tool message (TRL ends the episode); they are not TRL calls, and count in ``tools/parse_error_frequency``.
- Results keep the model's call order; dicts / lists become JSON (TRL: ``str()``); per-call timeout; arguments
  are checked against the schema (missing / unexpected / wrong type) before the call; long results can be cut.
"""

from posttrain.tools.environment import EnvironmentPool, EnvironmentSlot, environment_methods, prompt_with_observation
from posttrain.tools.executor import ToolExecutor, ToolResult, ToolStats, check_arguments, error_text, result_text
from posttrain.tools.parsers import (
    WITH_SPECIAL_TOKENS,
    ParsedTurn,
    ParseError,
    ToolCall,
    check_calls,
    get_parser,
    parse_gpt_oss,
    parse_hermes,
    parse_llama3,
    parse_mistral,
    parse_tool_calls,
    register_parser,
)
from posttrain.tools.response_schema import has_response_schema, parse_with_response_schema, regex_parser_for
from posttrain.tools.schema import check_template_renders_tools, tool_name, tool_schema, tool_schemas
from posttrain.tools.templates import CHATML_TOOL_TEMPLATE, chatml_tool_template, use_chatml_tool_template
from posttrain.tools.tokens import tool_suffix_ids

__all__ = [
    "CHATML_TOOL_TEMPLATE",
    "EnvironmentSlot",
    "EnvironmentPool",
    "ParseError",
    "ParsedTurn",
    "ToolCall",
    "ToolExecutor",
    "ToolResult",
    "ToolStats",
    "WITH_SPECIAL_TOKENS",
    "check_arguments",
    "check_calls",
    "check_template_renders_tools",
    "chatml_tool_template",
    "environment_methods",
    "error_text",
    "get_parser",
    "has_response_schema",
    "parse_gpt_oss",
    "parse_hermes",
    "parse_llama3",
    "parse_mistral",
    "parse_tool_calls",
    "parse_with_response_schema",
    "prompt_with_observation",
    "regex_parser_for",
    "register_parser",
    "result_text",
    "tool_name",
    "tool_schema",
    "tool_schemas",
    "tool_suffix_ids",
    "use_chatml_tool_template",
]
