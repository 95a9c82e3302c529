"""Response parsers (transformers' ``response_template`` format, what ``tokenizer.parse_response`` reads) for the
reply formats posttrain recognises, and how it recognises them: by the text a chat template renders for a probe tool
call (see `posttrain.data.chat_templates.add_response_schema`).

Each parser describes one assistant reply: where it starts (the role header the generation prompt ends with), its
optional reasoning, its tool calls and its text, each by the markers around it.
"""

from __future__ import annotations

_FUNCTION = {"type": "function", "function": {"name": "{name}", "arguments": "{content}"}}

# Hermes: ChatML turns, optional <think> reasoning, each call a JSON object {"name", "arguments"} in <tool_call> tags
# (Qwen 2.5, Qwen 3 and many fine-tunes).
HERMES_RESPONSE_TEMPLATE = {
    "defaults": {"role": "assistant"},
    "start_anchor": "<|im_start|>assistant\n",
    "fields": {
        "reasoning_content": {"open": "<think>", "close_pattern": r"</think>\s*", "content": "text"},
        "tool_calls": {
            "open": "<tool_call>",
            "close_pattern": r"</tool_call>\s*",
            "repeats": True,
            "content": "json",
            "transform": {"type": "function", "function": "{content}"},
        },
        "content": {"close_pattern": r"<\|im_end\|>\s*", "content": "text"},
    },
}

# Llama 3.1 / 3.2: one call per turn, a bare JSON object whose arguments key is "parameters".
LLAMA3_RESPONSE_TEMPLATE = {
    "defaults": {"role": "assistant"},
    "start_anchor": "<|start_header_id|>assistant<|end_header_id|>\n\n",
    "fields": {
        "tool_calls": {
            "open_pattern": r'\{"name":\s*"(?P<name>[^"]+)",\s*"parameters":\s*',
            "close_pattern": r"\}<\|eot_id\|>\s*",
            "repeats": True,
            "content": "json",
            "transform": _FUNCTION,
        },
        "content": {"close_pattern": r"<\|eot_id\|>\s*", "content": "text"},
    },
}

# GLM-4-MoE: `<|assistant|>`, reasoning in <think>, each call `<tool_call>NAME` then one
# `<arg_key>K</arg_key>\n<arg_value>V</arg_value>` pair per argument (string values raw, others JSON). The turn ends
# where the next role marker begins. Values are kept as text: `parse_response(..., tools=...)` types them from the
# tool's JSON schema.
GLM4MOE_RESPONSE_TEMPLATE = {
    "defaults": {"role": "assistant"},
    "start_anchor": "<|assistant|>",
    "fields": {
        "reasoning_content": {"open": "<think>", "close_pattern": r"</think>\s*", "content": "text"},
        "tool_calls": {
            "open_pattern": r"<tool_call>(?P<name>[^\s<]+)\s*",
            "close_pattern": r"</tool_call>\s*",
            "repeats": True,
            "content": "xml-inline",
            "content_args": {
                "tag_pattern": r"<arg_key>(?P<key>[^<]+)</arg_key>\s*<arg_value>(?P<value>[\s\S]*?)</arg_value>",
                "value_parser": {"name": "text"},
            },
            "transform": _FUNCTION,
        },
        "content": {"close_pattern": r"(?:<\|user\|>|<\|observation\|>|<\|system\|>)\s*|$", "content": "text"},
    },
}

# gpt-oss (harmony): reasoning on the analysis channel (the `thinking` field its template reads), the answer on the
# final channel, each call addressed `to=functions.NAME` on the commentary channel with JSON arguments.
GPTOSS_RESPONSE_TEMPLATE = {
    "defaults": {"role": "assistant"},
    "start_anchor": "<|start|>assistant",
    "fields": {
        "thinking": {
            "open": "<|channel|>analysis<|message|>",
            "close_pattern": r"<\|end\|>\s*",
            "content": "text",
        },
        "content": {
            "open": "<|channel|>final<|message|>",
            "close_pattern": r"<\|return\|>\s*",
            "content": "text",
        },
        "tool_calls": {
            "open_pattern": r"to=functions\.(?P<name>[^<\s]+?)<\|channel\|>commentary\s+json<\|message\|>",
            "close_pattern": r"<\|call\|>\s*",
            "repeats": True,
            "content": "json",
            "transform": _FUNCTION,
        },
    },
}

# LFM2.5: ChatML turns, reasoning in <think> (the `thinking` field its template reads), every call of a turn in one
# `<|tool_call_start|>[f(a='x', b=2), g()]<|tool_call_end|>` block of Python-style keyword calls.
LFM2_5_RESPONSE_TEMPLATE = {
    "defaults": {"role": "assistant"},
    "start_anchor": "<|im_start|>assistant\n",
    "fields": {
        "thinking": {"open": "<think>", "close_pattern": r"</think>\s*", "content": "text"},
        "tool_calls": {
            "open": "<|tool_call_start|>",
            "close_pattern": r"<\|tool_call_end\|>\s*",
            "content": "python-call-list",
            "transform": {"type": "function", "function": {"name": "{name}", "arguments": "{arguments}"}},
            "transform_each": True,
        },
        "content": {"close_pattern": r"<\|im_end\|>\s*", "content": "text"},
    },
}


# Gemma 4: `<|turn>model`, reasoning on the `<|channel>thought` channel, each call
# `<|tool_call>call:NAME{...}<tool_call|>` with JSON-like arguments (bare keys, strings between `<|"|>` marks). The turn
# ends at `<turn|>`, at the tool response the template opens after a call, or at EOS.
GEMMA4_RESPONSE_TEMPLATE = {
    "defaults": {"role": "assistant"},
    "start_anchor_pattern": r"(?:<\|turn>model\n|<tool_response\|>)",
    "fields": {
        "reasoning_content": {"open": "<|channel>thought\n", "close_pattern": r"<channel\|>\s*", "content": "text"},
        "tool_calls": {
            "open_pattern": r"<\|tool_call>call:(?P<name>[^{\s]+)",
            "close_pattern": r"<tool_call\|>\s*",
            "repeats": True,
            "content": "json",
            "content_args": {"string_delims": [['<|"|>', '<|"|>']], "unquoted_keys": True},
            "transform": _FUNCTION,
        },
        "content": {"close_pattern": r"(?:<turn\|>|<\|tool_response>|<eos>)\s*|$", "content": "text"},
    },
}

# DeepSeek-R1-Distill: no tool calls; the generation prompt opens `<think>`, so the reply's reasoning is whatever
# precedes a `</think>`, if one comes.
DEEPSEEK_R1_RESPONSE_TEMPLATE = {
    "defaults": {"role": "assistant"},
    "start_anchor_pattern": r"<｜Assistant｜>(?:<think>\n)?",
    "fields": {
        "reasoning_content": {
            "open_pattern": r"(?=[\s\S]*?</think>)",
            "close_pattern": r"</think>\s*",
            "content": "text",
        },
        "content": {"close_pattern": r"<｜end▁of▁sentence｜>\s*|$", "content": "text"},
    },
}


def xml_function_response_template(think_prefilled: bool) -> dict:
    """ChatML turns whose calls are `<tool_call>\\n<function=NAME>\\n<parameter=K>\\nV\\n</parameter>...` (Nemotron 3,
    Qwen 3.5). With `think_prefilled` (Nemotron 3: the generation prompt already opens `<think>`), the reply's
    reasoning is whatever precedes a `</think>`, if one comes; otherwise it is framed by `<think>` ... `</think>`.
    Values are kept as text (see GLM-4-MoE)."""
    if think_prefilled:
        start = {"start_anchor_pattern": r"<\|im_start\|>assistant\n<think>(?:\n|</think>)?"}
        reasoning = {"open_pattern": r"(?=[\s\S]*?</think>)", "close_pattern": r"</think>\s*", "content": "text"}
    else:
        start = {"start_anchor": "<|im_start|>assistant\n"}
        reasoning = {"open": "<think>", "close_pattern": r"</think>\s*", "content": "text"}
    return {
        "defaults": {"role": "assistant"},
        **start,
        "fields": {
            "reasoning_content": reasoning,
            "tool_calls": {
                "open_pattern": r"<tool_call>\s*<function=(?P<name>[^>\n]+)>\s*",
                "close_pattern": r"</function>\s*</tool_call>\s*",
                "repeats": True,
                "content": "xml-inline",
                "content_args": {
                    "tag_pattern": r"<parameter=(?P<key>[^>\n]+)>\n?(?P<value>[\s\S]*?)\n?</parameter>",
                    "value_parser": {"name": "text"},
                },
                "transform": _FUNCTION,
            },
            "content": {"close_pattern": r"<\|im_end\|>\s*", "content": "text"},
        },
    }


def response_template_for(rendered: str, generation_prompt: str, name: str, key: str, value: str) -> dict | None:
    """The parser for the reply format in `rendered` (a template's rendering of a user turn and an assistant turn
    calling tool `name` with {`key`: `value`}; `generation_prompt` is its rendering of the user turn with the
    generation prompt), or None for a format posttrain does not know."""
    arguments = f'{{"{key}": "{value}"}}'
    if "<|im_start|>assistant" in rendered:
        if f'<tool_call>\n{{"name": "{name}", "arguments": {arguments}}}\n</tool_call>' in rendered:
            return HERMES_RESPONSE_TEMPLATE
        if f"<tool_call>\n<function={name}>\n<parameter={key}>\n{value}\n</parameter>" in rendered:
            prefilled = generation_prompt.rstrip("\n").endswith(("<think>", "</think>"))
            return xml_function_response_template(think_prefilled=prefilled)
        if f"<|tool_call_start|>[{name}({key}='{value}')]<|tool_call_end|>" in rendered:
            return LFM2_5_RESPONSE_TEMPLATE
    if f'<|start_header_id|>assistant<|end_header_id|>\n\n{{"name": "{name}", "parameters": {arguments}}}' in rendered:
        return LLAMA3_RESPONSE_TEMPLATE
    if "<|assistant|>" in rendered and f"<tool_call>{name}\n<arg_key>{key}</arg_key>\n<arg_value>{value}" in rendered:
        return GLM4MOE_RESPONSE_TEMPLATE
    if f"<|start|>assistant to=functions.{name}<|channel|>commentary json<|message|>{arguments}<|call|>" in rendered:
        return GPTOSS_RESPONSE_TEMPLATE
    if f'<|turn>model\n<|tool_call>call:{name}{{{key}:<|"|>{value}<|"|>}}<tool_call|>' in rendered:
        return GEMMA4_RESPONSE_TEMPLATE
    if name not in rendered and generation_prompt.endswith("<｜Assistant｜><think>\n"):  # renders no tool calls
        return DEEPSEEK_R1_RESPONSE_TEMPLATE
    return None


__all__ = [
    "DEEPSEEK_R1_RESPONSE_TEMPLATE",
    "GEMMA4_RESPONSE_TEMPLATE",
    "GLM4MOE_RESPONSE_TEMPLATE",
    "GPTOSS_RESPONSE_TEMPLATE",
    "HERMES_RESPONSE_TEMPLATE",
    "LFM2_5_RESPONSE_TEMPLATE",
    "LLAMA3_RESPONSE_TEMPLATE",
    "response_template_for",
    "xml_function_response_template",
]
