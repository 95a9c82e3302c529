"""Training variants of the tool-calling model chat templates posttrain knows, and the lookup over every known family
(see `posttrain.data.template_patches` for how a family's edits work).

Besides ``{% generation %}`` markers, a tool-calling template must be prefix-preserving: the text of a conversation
must start with the text of the same conversation cut before a tool result, or a multi-turn tool rollout re-renders
(and re-tokenizes) what the model already generated. Where a model's template is not, its training variant changes
how history renders, and says so below.
"""

from __future__ import annotations

from posttrain.data.template_patches import ANY, PLAIN_FAMILIES, Edit, Family, patch_with

# Qwen 3 shows a turn's thinking only while it is the last turn or has reasoning: appending a tool result to a
# conversation would hide the empty think block of the turn before it. The training variant always shows every
# assistant turn's think block (empty when there is no reasoning), so a rendering never changes once written.
_QWEN3 = Family(
    "qwen3",
    (
        Edit(
            r"""{%- if loop.index0 > ns.last_query_index %}
            {%- if loop.last or (not loop.last and reasoning_content) %}
                {{- '<|im_start|>' + message.role + '\n<think>\n' + reasoning_content.strip('\n')
                    + '\n</think>\n\n' + content.lstrip('\n') }}
            {%- else %}
                {{- '<|im_start|>' + message.role + '\n' + content }}
            {%- endif %}
        {%- else %}
            {{- '<|im_start|>' + message.role + '\n' + content }}
        {%- endif %}""",
            r"""{{- '<|im_start|>' + message.role + '\n' }}{%- generation %}"""
            r"""{{- '<think>\n' + reasoning_content.strip('\n') + '\n</think>\n\n' + content.lstrip('\n') }}""",
        ),
        Edit(
            r"""{{- '<|im_end|>\n' }} {%- elif message.role == "tool" %}""",
            r"""{{- '<|im_end|>\n' }}{%- endgeneration %}{%- elif message.role == "tool" %}""",
        ),
    ),
    exact=False,
)

# Qwen3-Instruct-2507: Qwen 3's layout without thinking; already prefix-preserving.
_QWEN3_2507 = Family(
    "qwen3_instruct_2507",
    (
        Edit(
            r"""{{- '<|im_start|>' + message.role + '\n' + content }} {%- if message.tool_calls %}""",
            r"""{{- '<|im_start|>' + message.role + '\n' }}{%- generation %}"""
            r"""{{- content }}{%- if message.tool_calls %}""",
        ),
        _QWEN3.edits[1],
    ),
)

# Qwen 3.5 / 3.6 / 3.8 (thinking or not, `<function=...>` calls): as Qwen 3, every assistant turn shows its think
# block. The condition that hides it varies between versions.
_QWEN3_5 = Family(
    "qwen3_5",
    (
        Edit(
            "{%- if "
            + ANY
            + r""" %}
            {{- '<|im_start|>' + message.role + '\n<think>\n' + reasoning_content + '\n</think>\n\n' + content }}
        {%- else %}
            {{- '<|im_start|>' + message.role + '\n' + content }}
        {%- endif %}""",
            r"""{{- '<|im_start|>' + message.role + '\n' }}{%- generation %}"""
            r"""{{- '<think>\n' + reasoning_content + '\n</think>\n\n' + content }}""",
        ),
        _QWEN3.edits[1],
    ),
    exact=False,
)

# Qwen3-VL: Hermes calls, no thinking; the header is written on its own already.
_QWEN3_VL = Family(
    "qwen3_vl",
    (
        Edit(
            r"""{%- elif message.role == "assistant" %} {{- '<|im_start|>' + message.role + '\n' }}""",
            r"""{%- elif message.role == "assistant" %}{{- '<|im_start|>' + message.role + '\n' }}{%- generation %}""",
        ),
        _QWEN3.edits[1],
    ),
)

# Nemotron 3 (Nano, Super, Ultra): three ways to render an assistant turn, each gets its markers after the role header.
_NEMOTRON_3 = Family(
    "nemotron_3",
    (
        Edit("{%- set include_content = ", "{%- generation %}{%- set include_content = "),
        Edit(
            r"""{{- '</function>\n</tool_call>\n' -}} {%- endfor %} {{- '<|im_end|>\n' }}""",
            r"""{{- '</function>\n</tool_call>\n' -}}{%- endfor %}{{- '<|im_end|>\n' }}{%- endgeneration %}""",
        ),
        Edit(
            r"""{{- '<|im_start|>assistant\n' ~ (content | default('', true) | string | trim) ~ '<|im_end|>\n' }}""",
            r"""{{- '<|im_start|>assistant\n' }}{%- generation %}"""
            r"""{{- (content | default('', true) | string | trim) ~ '<|im_end|>\n' }}{%- endgeneration %}""",
        ),
        Edit(
            r"""{{- '<|im_start|>assistant\n' ~ c ~ '<|im_end|>\n' }}""",
            r"""{{- '<|im_start|>assistant\n' }}{%- generation %}{{- c ~ '<|im_end|>\n' }}{%- endgeneration %}""",
        ),
        Edit(
            r"""{{- '<|im_start|>assistant\n<|im_end|>\n' }}""",
            r"""{{- '<|im_start|>assistant\n' }}{%- generation %}{{- '<|im_end|>\n' }}{%- endgeneration %}""",
        ),
    ),
)

# GLM-4-MoE ends no turn with a token of its own: the next message's role marker (<|user|>, <|observation|>, ...)
# ends it. The training variant renders that marker at the end of the assistant turn, inside the generation block
# (the model must learn to emit it to stop), and the next message leaves it out. A final assistant turn gets the
# marker its output stops on: <|observation|> after tool calls, <|user|> otherwise. So a conversation ending in an
# assistant turn renders one marker longer than with the original template; everything else renders the same.
_GLM4MOE_CLOSE = (
    "{%- if loop.last %}{%- if not add_generation_prompt %}{{- '<|observation|>' if m.tool_calls else '<|user|>' }}"
    "{%- endif %}"
    "{%- elif messages[loop.index0 + 1].role == 'tool' %}{{- '<|observation|>' }}"
    "{%- elif messages[loop.index0 + 1].role in ['user', 'system'] %}"
    "{{- '<|' + messages[loop.index0 + 1].role + '|>' }}"
    "{%- endif %}"
)
_AFTER_ASSISTANT = "messages[loop.index0 - 1].role != 'assistant'"
_GLM4MOE = Family(
    "glm4moe",
    (
        Edit(
            "{%- if m.role == 'user' -%}<|user|>\n{{ visible_text(m.content) }}",
            "{%- if m.role == 'user' -%}{%- if loop.first or " + _AFTER_ASSISTANT + " %}<|user|>{%- endif %}"
            "{{ '\\n' + visible_text(m.content) }}",
        ),
        Edit(
            "{%- elif m.role == 'system' -%}\n<|system|>\n{{ visible_text(m.content) }}",
            "{%- elif m.role == 'system' -%}{%- if loop.first or " + _AFTER_ASSISTANT + " %}<|system|>{%- endif %}"
            "{{ '\\n' + visible_text(m.content) }}",
        ),
        Edit(
            """{%- if loop.first or (messages[loop.index0 - 1].role != "tool") %}\n{{- '<|observation|>' }}""",
            """{%- if loop.first or messages[loop.index0 - 1].role not in ["tool", "assistant"] %}"""
            "{{- '<|observation|>' }}",
        ),
        Edit(
            "<|observation|>{% for tr in m.content %}",
            "{% if loop.first or " + _AFTER_ASSISTANT + " %}<|observation|>{% endif %}{% for tr in m.content %}",
        ),
        Edit(
            "{%- if loop.index0 > ns.last_user_index and reasoning_content -%}",
            "{%- generation %}{%- if loop.index0 > ns.last_user_index and reasoning_content -%}",
        ),
        Edit(
            "</tool_call>{% endfor %}\n{% endif %}\n{%- elif m.role == 'tool' -%}",
            "</tool_call>{% endfor %}{% endif %}"
            + _GLM4MOE_CLOSE
            + "{%- endgeneration %}{%- elif m.role == 'tool' -%}",
        ),
    ),
    exact=False,
)

# gpt-oss: the whole assistant message (its channel headers included, they are the model's output) is trained.
_GPTOSS = Family(
    "gptoss",
    (
        Edit("""{%- if "tool_calls" in message %}""", """{%- generation %}{%- if "tool_calls" in message %}"""),
        Edit(
            "{%- endif %} {%- elif message.role == 'tool' -%}",
            "{%- endif %}{%- endgeneration %}{%- elif message.role == 'tool' -%}",
        ),
    ),
)

# DeepSeek-V3: the role token <｜Assistant｜> (the generation prompt) stays outside the generation block; tool-call
# arguments may be a mapping (the documented form, which the original fails on) as well as a JSON string.
_DS_ARGS = "tool['function']['arguments']"
_DEEPSEEKV3 = Family(
    "deepseekv3",
    (
        Edit(
            "{%- if message['role'] == 'assistant' and 'tool_calls' in message %}{%- set ns.is_tool = false -%}",
            "{%- if message['role'] == 'assistant' and 'tool_calls' in message %}{%- set ns.is_tool = false -%}"
            "{%- if not ns.is_first %}{{'<｜Assistant｜>'}}{%- endif %}{%- generation %}",
        ),
        Edit("{{'<｜Assistant｜><｜tool▁calls▁begin｜>", "{{'<｜tool▁calls▁begin｜>"),
        Edit(
            "{{'<｜Assistant｜>' + message['content'] + '<｜tool▁calls▁begin｜>",
            "{{message['content'] + '<｜tool▁calls▁begin｜>",
        ),
        Edit(f"+ {_DS_ARGS} +", f"+ ({_DS_ARGS} if {_DS_ARGS} is string else {_DS_ARGS} | tojson) +"),
        Edit(
            "{{'<｜tool▁calls▁end｜><｜end▁of▁sentence｜>'}}",
            "{{'<｜tool▁calls▁end｜><｜end▁of▁sentence｜>'}}{%- endgeneration %}",
        ),
        Edit(
            "{{'<｜tool▁outputs▁end｜>' + message['content'] + '<｜end▁of▁sentence｜>'}}",
            "{{'<｜tool▁outputs▁end｜>'}}{%- generation %}{{message['content'] + '<｜end▁of▁sentence｜>'}}"
            "{%- endgeneration %}",
        ),
        Edit(
            "{{'<｜Assistant｜>' + content + '<｜end▁of▁sentence｜>'}}",
            "{{'<｜Assistant｜>'}}{%- generation %}{{content + '<｜end▁of▁sentence｜>'}}{%- endgeneration %}",
        ),
    ),
    exact=False,
)

# DeepSeek-R1-Distill: DeepSeek-V3's layout, told apart by `content is none` marking a tool-call turn.
_DEEPSEEK_R1_DISTILL = Family(
    "deepseek_r1_distill",
    (
        Edit(
            "{%- if message['role'] == 'assistant' and message['content'] is none %}{%- set ns.is_tool = false -%}",
            "{%- if message['role'] == 'assistant' and message['content'] is none %}{%- set ns.is_tool = false -%}"
            "{%- if not ns.is_first %}{{'<｜Assistant｜>'}}{%- endif %}{%- generation %}",
        ),
        _DEEPSEEKV3.edits[1],
        _DEEPSEEKV3.edits[3],
        Edit(
            "{%- endfor %}{%- endif %}{%- if message['role'] == 'assistant' and message['content'] is not none %}",
            "{%- endfor %}{%- endgeneration %}{%- endif %}"
            "{%- if message['role'] == 'assistant' and message['content'] is not none %}",
        ),
        *_DEEPSEEKV3.edits[5:],
    ),
    exact=False,
)

TOOL_FAMILIES: tuple[Family, ...] = (
    _QWEN3,
    _QWEN3_5,
    _QWEN3_VL,
    _DEEPSEEK_R1_DISTILL,
    _QWEN3_2507,
    _NEMOTRON_3,
    _GLM4MOE,
    _GPTOSS,
    _DEEPSEEKV3,
)
FAMILIES: tuple[Family, ...] = (*TOOL_FAMILIES, *PLAIN_FAMILIES)


def patch_chat_template(chat_template: str) -> tuple[Family, str] | None:
    """The known family `chat_template` belongs to and its training variant (the model's template with the family's
    edits), or None for a template of no known family."""
    return patch_with(FAMILIES, chat_template)


__all__ = ["FAMILIES", "TOOL_FAMILIES", "patch_chat_template"]
