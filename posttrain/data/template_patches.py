"""Training variants of known model chat templates, made by patching the model's own template.

A model family's chat template is a fact about the model; to train on its assistant turns only, the template has to
mark the assistant's output with ``{% generation %}`` ... ``{% endgeneration %}`` (what transformers reads for
``return_assistant_tokens_mask``), and for tool episodes earlier turns must render the same whatever follows them.

Each family below is a list of edits to its template: an anchor (a piece of the original template, matched with any
run of whitespace standing for any other, so re-indented copies of a template still match) and what replaces it. A
template is a family's when every anchor of that family is found in it; the edits are then applied to the template the
model ships (not to a stored copy). This module has the plain chat families, the vision ones and LFM2 (whose
templates need nothing but the markers); `posttrain.data.training_templates` has the tool-calling families whose
history rendering or tool-call layout needs more, and the lookup over all of them.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

# In an anchor, a word of its own that stands for any text within one line (a condition that varies between versions).
ANY = "(...)"


@dataclass(frozen=True)
class Edit:
    """Replace every occurrence of `anchor` (whitespace-tolerant; `ANY` matches any text within a line) with
    `replacement`; `anchor` must occur."""

    anchor: str
    replacement: str

    def pattern(self) -> re.Pattern:
        pieces = [r"[^\n]*?" if p == ANY else re.escape(p) for p in self.anchor.split()]
        return re.compile(r"\s*".join(pieces))


@dataclass(frozen=True)
class Family:
    """A model family's chat template patch. `exact`: the training template renders every conversation like the
    original (False where the training variant deliberately differs, e.g. Qwen 3 keeps every turn's thinking)."""

    name: str
    edits: tuple[Edit, ...]
    exact: bool = True


def _e(anchor: str, replacement: str) -> Edit:
    return Edit(anchor, replacement)


# Plain chat families (no tool calls in the template): the assistant's text and its end-of-turn token are trained,
# the role header that opens the turn (the generation prompt) is not.
_COHERE = Family(
    "cohere",
    (
        _e(
            "{{ '<|START_OF_TURN_TOKEN|><|CHATBOT_TOKEN|>' + content.strip() + '<|END_OF_TURN_TOKEN|>' }}",
            "{{ '<|START_OF_TURN_TOKEN|><|CHATBOT_TOKEN|>' }}{% generation %}"
            "{{ content.strip() + '<|END_OF_TURN_TOKEN|>' }}{% endgeneration %}",
        ),
    ),
)

# Cohere 2 closes every turn after the role branches; the close moves into each branch so the assistant's can be
# trained.
_COHERE2 = Family(
    "cohere2",
    (
        _e(
            "<|USER_TOKEN|>{{ message['content'] }}{% elif role == 'assistant' or role == 'chatbot' %}"
            "<|CHATBOT_TOKEN|><|START_RESPONSE|>{{ message['content'] }}<|END_RESPONSE|>"
            "{% elif role == 'system' %}<|SYSTEM_TOKEN|>{{ message['content'] }}{% endif %}<|END_OF_TURN_TOKEN|>",
            "<|USER_TOKEN|>{{ message['content'] }}<|END_OF_TURN_TOKEN|>"
            "{% elif role == 'assistant' or role == 'chatbot' %}"
            "<|CHATBOT_TOKEN|><|START_RESPONSE|>{% generation %}{{ message['content'] }}<|END_RESPONSE|>"
            "<|END_OF_TURN_TOKEN|>{% endgeneration %}"
            "{% elif role == 'system' %}<|SYSTEM_TOKEN|>{{ message['content'] }}<|END_OF_TURN_TOKEN|>"
            "{% else %}<|END_OF_TURN_TOKEN|>{% endif %}",
        ),
    ),
)

# Gemma (1 and 2 ship the same template): one expression renders every turn; the model's turn is split off.
_GEMMA = Family(
    "gemma",
    (
        _e(
            "{{ '<start_of_turn>' + role + '\n' + message['content'] | trim + '<end_of_turn>\n' }}",
            "{{ '<start_of_turn>' + role + '\\n' }}{% if role == 'model' %}{% generation %}"
            "{{ message['content'] | trim + '<end_of_turn>\\n' }}{% endgeneration %}"
            "{% else %}{{ message['content'] | trim + '<end_of_turn>\\n' }}{% endif %}",
        ),
    ),
)

_LFM2 = Family(
    "lfm2",
    (
        _e(
            '{{- content + "<|im_end|>\\n" -}} {%- endfor -%}',
            '{%- if message["role"] == "assistant" -%}{% generation %}{{- content + "<|im_end|>\\n" -}}'
            '{% endgeneration %}{%- else -%}{{- content + "<|im_end|>\\n" -}}{%- endif -%}{%- endfor -%}',
        ),
    ),
)

# Llama 3 (not 3.1 / 3.2, which have their own tool templates) builds each turn in a variable; it is rendered in
# pieces instead, the assistant's text and <|eot_id|> in the generation block.
_LLAMA3 = Family(
    "llama3",
    (
        _e(
            "{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'+ message['content'] "
            "| trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}"
            "{{ content }}",
            "{% if loop.index0 == 0 %}{{ bos_token }}{% endif %}"
            "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' }}"
            "{% if message['role'] == 'assistant' %}{% generation %}{{ message['content'] | trim + '<|eot_id|>' }}"
            "{% endgeneration %}{% else %}{{ message['content'] | trim + '<|eot_id|>' }}{% endif %}",
        ),
    ),
)

# Phi-3 / 3.5 end a conversation without a generation prompt with EOS; after a final assistant turn that EOS is what
# the model emits to stop, so it is trained too.
_PHI3_TAIL = _e(
    "{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% else %}{{ eos_token }}{% endif %}",
    "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% elif messages[-1]['role'] == 'assistant' %}"
    "{% generation %}{{ eos_token }}{% endgeneration %}{% else %}{{ eos_token }}{% endif %}",
)
_PHI3_ASSISTANT = _e(
    "{{'<|assistant|>\n' + message['content'] + '<|end|>\n'}}",
    "{{ '<|assistant|>\\n' }}{% generation %}{{ message['content'] + '<|end|>\\n' }}{% endgeneration %}",
)
_PHI3 = Family("phi3", (_PHI3_ASSISTANT, _PHI3_TAIL))

# LFM2 with tool calls (v2): the assistant branch with calls and the plain one are both marked.
_LFM2_V2 = Family(
    "lfm2_v2",
    (
        _e(
            '{%- if message["role"] == "assistant" and message.get("tool_calls") -%}',
            '{%- if message["role"] == "assistant" and message.get("tool_calls") -%}{%- generation -%}',
        ),
        _e(
            '{{- render_tool_calls(message["tool_calls"]) -}} {{- "<|im_end|>\\n" -}}',
            '{{- render_tool_calls(message["tool_calls"]) -}}{{- "<|im_end|>\\n" -}}{%- endgeneration -%}',
        ),
        _e(
            '{%- else -%} {{- content + "<|im_end|>\\n" -}} {%- endif -%} {%- endfor -%}',
            '{%- elif message["role"] == "assistant" -%}{%- generation -%}{{- content + "<|im_end|>\\n" -}}'
            '{%- endgeneration -%}{%- else -%}{{- content + "<|im_end|>\\n" -}}{%- endif -%}{%- endfor -%}',
        ),
    ),
)


def _captured(role_test: str) -> str:
    """Writes out a `{% set body %}` capture of one turn's rendering (ended just before), inside the generation block
    when `role_test` (a Jinja test of the turn) holds."""
    return (
        "{%- if " + role_test + " -%}{%- generation -%}{{- body -}}{%- endgeneration -%}"
        "{%- else -%}{{- body -}}{%- endif -%}"
    )


# The vision templates below render a turn's content (text and image placeholders) in one loop shared by all roles;
# the loop's output is captured in a variable and written inside the generation block for the assistant.
_QWEN2_5_VL = Family(  # also Qwen2-VL, which ships the same template
    "qwen2_5_vl",
    (
        _e(
            "<|im_start|>{{ message['role'] }}\n{% if message['content'] is string %}",
            "<|im_start|>{{ message['role'] }}\n{% set body %}{% if message['content'] is string %}",
        ),
        _e(
            "<|im_end|>\n{% endif %}{% endfor %}{% if add_generation_prompt %}",
            "<|im_end|>\n{% endif %}{% endset %}" + _captured("message['role'] == 'assistant'") + "{% endfor %}"
            "{% if add_generation_prompt %}",
        ),
    ),
)
_GEMMA3 = Family(
    "gemma3",
    (
        _e(
            """{{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else "") }}""",
            """{{ '<start_of_turn>' + role + '\\n' + (first_user_prefix if loop.first else "") }}{%- set body -%}""",
        ),
        _e("{{ '<end_of_turn>\n' }}", "{{ '<end_of_turn>\\n' }}{%- endset -%}" + _captured("role == 'model'")),
    ),
)
# Idefics3 and SmolVLM: "Assistant:" is the generation prompt; the space after it (none before an image) is output.
_IDEFICS3 = Family(
    "idefics3",
    (
        _e(
            "{% if message['content'][0]['type'] == 'image' %}{{':'}}{% else %}{{': '}}{% endif %}",
            "{{':'}}{% set body %}{% if message['content'][0]['type'] != 'image' %}{{' '}}{% endif %}",
        ),
        _e(
            "<end_of_utterance>\n{% endfor %}",
            "<end_of_utterance>\n{% endset %}" + _captured("message['role'] == 'assistant'") + "{% endfor %}",
        ),
    ),
)
# LLaVA-NeXT renders no generation prompt; the reply (with the space before it, which its first token carries) and
# </s> are trained, the space after them is not.
_LLAVA_NEXT = Family(
    "llava_next",
    (
        _e(
            "{{ ' ' + message['content'][0]['text'] + '</s> '}}",
            "{% generation %}{{ ' ' + message['content'][0]['text'] + '</s>' }}{% endgeneration %}{{ ' ' }}",
        ),
    ),
)

# Muse Glimmer: every part of an assistant message (reasoning to self, calls, reply) is the model's output.
_MUSE_GLIMMER = Family(
    "muse_glimmer",
    (
        _e(
            "{%- elif role == 'assistant' -%} {%- if message.get('reasoning_content') -%}",
            "{%- elif role == 'assistant' -%}{%- generation %}{%- if message.get('reasoning_content') -%}",
        ),
        _e(
            "{{- ('<|eot|>' if end_turn else '<|eom|>') -}} {%- endif -%} {%- endif -%} {%- endfor -%}",
            "{{- ('<|eot|>' if end_turn else '<|eom|>') -}}{%- endif -%}{%- endgeneration %}"
            "{%- endif -%}{%- endfor -%}",
        ),
    ),
)

# DiffusionGemma and Gemma 4 (the layout of its latest template): the thinking channel, the calls, the reply and the
# closing <turn|> of a model turn are output; tool responses written into the turn are not.
_MODEL_ONLY = "{%- if role == 'model' -%}{%- generation %}{0}{%- endgeneration %}{%- else -%}{0}{%- endif -%}"
_DIFFUSION_GEMMA = Family(
    "diffusion_gemma_gemma4",
    (
        _e(
            "{{- '<|channel>thought\\n' + thinking_text + '\\n<channel|>' -}}",
            "{%- generation %}{{- '<|channel>thought\\n' + thinking_text + '\\n<channel|>' -}}{%- endgeneration %}",
        ),
        _e(
            "{%- if message.get('tool_calls') -%} {%- for tool_call in message.get('tool_calls') -%}",
            "{%- if message.get('tool_calls') -%}{%- generation %}{%- for tool_call in message.get('tool_calls') -%}",
        ),
        _e("{{- '}<tool_call|>' -}} {%- endfor -%}", "{{- '}<tool_call|>' -}}{%- endfor -%}{%- endgeneration %}"),
        _e("{{- captured_content -}}", _MODEL_ONLY.replace("{0}", "{{- captured_content -}}")),
        _e(
            "{%- elif not (ns_tr_out.flag and not has_content and not next_nt.found) -%} {{- '<turn|>\\n' -}}",
            "{%- elif not (ns_tr_out.flag and not has_content and not next_nt.found) -%}"
            + _MODEL_ONLY.replace("{0}", "{{- '<turn|>\\n' -}}"),
        ),
    ),
)

PLAIN_FAMILIES: tuple[Family, ...] = (
    _MUSE_GLIMMER,
    _DIFFUSION_GEMMA,
    _LFM2_V2,
    _QWEN2_5_VL,
    _GEMMA3,
    _IDEFICS3,
    _LLAVA_NEXT,
    _COHERE,
    _COHERE2,
    _GEMMA,
    _LFM2,
    _LLAMA3,
    _PHI3,
)


def patch_with(families, chat_template: str) -> tuple[Family, str] | None:
    """The first of `families` whose anchors are all in `chat_template`, with the template its edits give; None if
    none matches."""
    for family in families:
        patterns = [edit.pattern() for edit in family.edits]
        if not all(p.search(chat_template) for p in patterns):
            continue
        patched = chat_template
        for edit, pattern in zip(family.edits, patterns):
            patched = pattern.sub(lambda _m, r=edit.replacement: r, patched)
        return family, patched
    return None


__all__ = ["ANY", "PLAIN_FAMILIES", "Edit", "Family", "patch_with"]
