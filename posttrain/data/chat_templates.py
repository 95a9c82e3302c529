"""Chat-template tools with TRL's names: copy a template (and its tokens) from another tokenizer, check
that a template renders tool calls, set a response parser, and get a template fit for assistant-only
training.

TRL recognises templates by comparing them with copies of ~30 model templates it ships. posttrain
recognises a reply format by what the template renders (probe conversations: ChatML turns, Hermes
``<tool_call>`` JSON, Llama 3 headers, ...), and a model family's template by the pieces of it that the
family's training edits replace (`posttrain.data.training_templates`). Formats it does not know raise the
same ValueError as TRL's unknown templates.
"""

from __future__ import annotations

import json
import re
import warnings

from jinja2 import TemplateError
from transformers import AddedToken, AutoTokenizer, ProcessorMixin

from posttrain.data.response_templates import response_template_for
from posttrain.data.training_templates import patch_chat_template
from posttrain.data.transforms import prepare_multimodal_messages

# Distinct strings, so that the rendered text shows which part of a tool exchange a template kept.
_NAME, _ARG_KEY, _ARG_VALUE, _RESULT = "probe_fn_4c1e", "probe_key_9a2d", "probe_val_7b3f", "probe_out_2e8c"


def _tool_exchange(arguments) -> list[dict]:
    call = {"type": "function", "function": {"name": _NAME, "arguments": arguments}}
    return [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "name": _NAME, "content": _RESULT},
    ]


def _render_tool_exchange(processing_class, n_messages: int = 3) -> str | None:
    """The template's rendering of user -> assistant tool call -> tool result (first `n_messages`), or None
    if the template rejects it. Templates that only take JSON-string arguments get them as a string."""
    for arguments in ({_ARG_KEY: _ARG_VALUE}, json.dumps({_ARG_KEY: _ARG_VALUE})):
        messages = _tool_exchange(arguments)[:n_messages]
        if isinstance(processing_class, ProcessorMixin):
            messages = prepare_multimodal_messages(messages)
        try:
            return processing_class.apply_chat_template(messages, tokenize=False)
        except TemplateError:
            return None
        except TypeError:
            continue
    return None


def supports_tool_calling(processing_class) -> bool:
    """Tells whether a chat template can show tools, tool calls and their results, as `tools=` training needs.

    True if the chat template renders a whole tool exchange (the call's name and arguments and the tool's
    result all appear in the text). Templates that fail on the tool role, or silently drop the calls or the
    results, give False.

    See docs/tools.md.
    """
    if processing_class.chat_template is None:
        return False
    rendered = _render_tool_exchange(processing_class)
    return rendered is not None and all(s in rendered for s in (_NAME, _ARG_KEY, _ARG_VALUE, _RESULT))


def has_generation_markers(chat_template: str | dict) -> bool:
    """True if the template marks assistant output with ``{% generation %}`` (any whitespace-trim form)."""
    if isinstance(chat_template, dict):
        chat_template = chat_template["default"]
    return re.search(r"\{%-?\s*generation\s*-?%\}", chat_template) is not None


def is_chat_template_prefix_preserving(processing_class) -> bool:
    """True if a conversation's tokens start with the tokens of its first turns rendered alone: appending a
    tool result (and a generation prompt) must not change how the earlier turns render."""
    short, long = _tool_exchange({})[:2], _tool_exchange({})

    def ids(messages, **kwargs):
        try:
            out = processing_class.apply_chat_template(messages, tokenize=True, return_dict=False, **kwargs)
        except TypeError:
            for m in messages:
                for call in m.get("tool_calls", []):
                    call["function"]["arguments"] = "{}"
            out = processing_class.apply_chat_template(messages, tokenize=True, return_dict=False, **kwargs)
        return out[0] if out and isinstance(out[0], list) else out

    first = ids(short)
    return ids(long, add_generation_prompt=True)[: len(first)] == first


def clone_chat_template(model, tokenizer, source_tokenizer_path: str, resize_to_multiple_of: int | None = 64):
    """Gives a tokenizer (and its model) another tokenizer's chat template, for models that have none or the wrong one.

    Gives `tokenizer` (and `model`) the chat template of the tokenizer at `source_tokenizer_path`.

    Copies the template, adds the source's added tokens the target lacks, takes the source's EOS token
    (also as the model's and its generation config's ``eos_token_id``), and resizes the embeddings to the
    vocabulary, rounded up to `resize_to_multiple_of`; rows the rounding adds get ``<extra_id_N>`` tokens so
    that vocabulary and embeddings stay the same size. Returns ``(model, tokenizer, added_token_ids)``.

    See docs/dataset_formats.md.
    """
    source = AutoTokenizer.from_pretrained(source_tokenizer_path)
    tokenizer.chat_template = source.get_chat_template()
    added = [t for t in source.added_tokens_decoder.values() if t.content not in tokenizer.vocab]
    tokenizer.add_tokens(added)
    tokenizer.eos_token = source.eos_token
    model.config.get_text_config().eos_token_id = tokenizer.eos_token_id
    if model.can_generate():
        model.generation_config.eos_token_id = tokenizer.eos_token_id
    # len(tokenizer.vocab) counts base and added tokens alike, whatever the tokenizer's class.
    model.resize_token_embeddings(new_num_tokens=len(tokenizer.vocab), pad_to_multiple_of=resize_to_multiple_of)
    n = 0
    while model.vocab_size > len(tokenizer.vocab):
        filler = AddedToken(f"<extra_id_{n}>")
        if tokenizer.add_tokens(filler) == 1:
            added.append(filler)
        n += 1
    if len(tokenizer.vocab) != model.vocab_size:
        raise RuntimeError(
            f"clone_chat_template: the tokenizer has {len(tokenizer.vocab)} tokens but the model's "
            f"embeddings have {model.vocab_size} rows after resizing."
        )
    return model, tokenizer, tokenizer.convert_tokens_to_ids([t.content for t in added])


def add_response_schema(processing_class):
    """Teaches a tokenizer how to parse its model's replies (tool calls included), as tool-calling training needs.

    Sets ``response_template`` (what ``tokenizer.parse_response`` reads) on the tokenizer, or a processor's
    inner tokenizer, for the reply format its chat template renders: Hermes ``<tool_call>`` JSON in ChatML
    turns (Qwen 2.5 / 3 and similar, with optional ``<think>`` reasoning), Llama 3.1 / 3.2 JSON calls, GLM-4-MoE
    ``<arg_key>`` calls, gpt-oss harmony channels, LFM2.5 Python-style calls, ``<function=...>`` XML calls
    (Nemotron 3, Qwen 3.5), Gemma 4 ``<|tool_call>call:`` calls, or DeepSeek-R1-Distill replies (no tool calls).
    The format is recognised from what the template renders for a probe tool call. Returns the same object; other
    formats raise ValueError.

    See docs/tools.md.
    """
    tokenizer = processing_class.tokenizer if isinstance(processing_class, ProcessorMixin) else processing_class
    found = None
    if processing_class.chat_template is not None:
        rendered = _render_tool_exchange(processing_class, n_messages=2) or ""
        prompt = _tool_exchange({})[:1]
        if isinstance(processing_class, ProcessorMixin):
            prompt = prepare_multimodal_messages(prompt)
        try:
            generation_prompt = processing_class.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True)
        except TemplateError:
            generation_prompt = ""
        found = response_template_for(rendered, generation_prompt, _NAME, _ARG_KEY, _ARG_VALUE)
    if found is None:
        raise ValueError(
            "Unrecognized chat template, failed to add response schema: posttrain recognises templates that render "
            "Hermes <tool_call> JSON, Llama 3 JSON, GLM-4-MoE, gpt-oss, LFM2.5, Gemma 4 or <function=...> XML tool "
            "calls. Set `response_template` on the tokenizer yourself (see transformers' chat response parsing docs)."
        )
    tokenizer.response_template = found
    return processing_class


def _literal(text: str | None) -> str:
    """`text` as a Jinja expression (a string literal, or none)."""
    return "none" if text is None else json.dumps(text)


def chatml_turns(newline_in_generation: bool) -> str:
    """The message loop shared by posttrain's ChatML templates (after the system turn they each render): each
    assistant reply, Hermes ``<tool_call>`` JSON included, inside ``{% generation %}`` with its ``<|im_end|>`` (and
    the newline after it when `newline_in_generation`: a training template trains it, a rollout template leaves it
    to the next turn's prefix); consecutive tool results in one user turn of ``<tool_response>`` blocks."""
    end = (
        "{{- '<|im_end|>\\n' }}{%- endgeneration %}"
        if newline_in_generation
        else ("{{- '<|im_end|>' }}{%- endgeneration %}{{- '\\n' }}")
    )
    return (
        "{%- for message in messages %}"
        "{%- if loop.first and message['role'] == 'system' %}"
        "{%- elif message['role'] == 'assistant' %}"
        "{{- '<|im_start|>assistant\\n' }}{%- generation %}{{- message['content'] or '' }}"
        "{%- for call in message['tool_calls'] or [] %}"
        "{%- set call = call['function'] if call['function'] is defined else call %}"
        "{%- if message['content'] or not loop.first %}{{- '\\n' }}{%- endif %}"
        "{{- '<tool_call>\\n{\"name\": \"' + call['name'] + '\", \"arguments\": ' }}"
        "{%- if call['arguments'] is string %}{{- call['arguments'] }}{%- else %}{{- call['arguments'] | tojson }}"
        "{%- endif %}"
        "{{- '}\\n</tool_call>' }}"
        "{%- endfor %}" + end + "{%- elif message['role'] == 'tool' %}"
        "{%- if loop.first or messages[loop.index0 - 1]['role'] != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}"
        "{{- '\\n<tool_response>\\n' + message['content'] + '\\n</tool_response>' }}"
        "{%- if loop.last or messages[loop.index0 + 1]['role'] != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}"
        "{%- else %}"
        "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
        "{%- endif %}"
        "{%- endfor %}"
        "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
    )


def _chatml_training_template(default_system: str | None, tools_format: dict | None = None) -> str:
    """A ChatML template with ``{% generation %}`` around each assistant reply (text and tool calls) and its
    end-of-turn; a conversation without a system turn gets `default_system` first, if any. With
    `tools_format` (the tool preamble pieces of the original), tools are listed in the system turn, calls are
    Hermes ``<tool_call>`` JSON and consecutive tool results share one user turn of ``<tool_response>``s."""
    t = tools_format or {}
    system = (
        "{%- set has_system = messages[0]['role'] == 'system' %}"
        "{%- if tools and " + ("true" if tools_format else "false") + " %}"
        "{{- '<|im_start|>system\\n' + (messages[0]['content'] if has_system else "
        + _literal(t.get("default"))
        + ") + "
        + _literal(t.get("prefix"))
        + " }}"
        "{%- for tool in tools %}{{- " + _literal(t.get("separator")) + " + (tool | tojson) }}{%- endfor %}"
        "{{- " + _literal(t.get("suffix")) + " }}"
        "{%- elif has_system %}{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}"
        "{%- elif " + _literal(default_system) + " is not none %}"
        "{{- '<|im_start|>system\\n' + " + _literal(default_system) + " + '<|im_end|>\\n' }}"
        "{%- endif %}"
    )
    return system + chatml_turns(newline_in_generation=True)


_CALL = {"type": "function", "function": {"name": "get_time", "arguments": {"city": "Paris"}}}
_PROBES = (
    ([{"role": "user", "content": "Is 2+2=4?"}, {"role": "assistant", "content": "Yes."}], False),
    (
        [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "a"},
            {"role": "assistant", "content": "b"},
            {"role": "user", "content": "c"},
            {"role": "assistant", "content": "d"},
        ],
        False,
    ),
    ([{"role": "user", "content": "Hello"}], True),
    ([{"role": "system", "content": "S"}, {"role": "user", "content": "Hello"}], True),
)
_TOOL_PROBES = (
    (
        [
            {"role": "user", "content": "Time?"},
            {"role": "assistant", "content": "", "tool_calls": [_CALL, _CALL]},
            {"role": "tool", "content": "9:00"},
            {"role": "tool", "content": "9:01"},
            {"role": "assistant", "content": "Nine."},
        ],
        False,
    ),
    (
        [
            {"role": "system", "content": "S"},
            {"role": "user", "content": "Time?"},
            {"role": "assistant", "content": "Checking.", "tool_calls": [_CALL]},
            {"role": "tool", "content": "9:00"},
        ],
        True,
    ),
)
_PROBE_TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_time",
            "description": "Time in a city.",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]


def _renders_like(tokenizer, template: str, with_tools: bool, patched_family=None, original: str | None = None) -> bool:
    """True if `template` renders the probe conversations (with tools too when `with_tools`) like `original` (default:
    the tokenizer's own).
    For a `patched_family` (see `posttrain.data.training_templates`), probes the original rejects are left out, and
    only those without an assistant turn count unless the family's variant renders everything the same."""
    probes = [(m, g, None) for m, g in _PROBES]
    if with_tools:
        probes += [(m, g, None) for m, g in _TOOL_PROBES] + [(m, g, _PROBE_TOOLS) for m, g in _PROBES + _TOOL_PROBES]
    if patched_family is not None and not patched_family.exact:
        probes = [(m, g, t) for m, g, t in probes if all(x["role"] != "assistant" for x in m)]
    for messages, prompt, tools in probes:
        try:
            expected = tokenizer.apply_chat_template(
                messages, tools=tools, tokenize=False, add_generation_prompt=prompt, chat_template=original
            )
        except (TemplateError, TypeError):
            if patched_family is None:
                return False
            continue
        try:
            got = tokenizer.apply_chat_template(
                messages, tools=tools, tokenize=False, add_generation_prompt=prompt, chat_template=template
            )
        except (TemplateError, TypeError):
            return False
        if got != expected:
            return False
    return True


def _default_system(tokenizer) -> str | None:
    try:
        rendered = tokenizer.apply_chat_template([{"role": "user", "content": "Hello"}], tokenize=False)
    except TemplateError:
        return None
    found = re.match(r"<\|im_start\|>system\n(.*?)<\|im_end\|>\n<\|im_start\|>user", rendered, flags=re.S)
    return found.group(1) if found else None


def _tools_format(tokenizer) -> dict | None:
    """The pieces of the original's tool preamble: the system text used without a system turn, the text
    before the tool list, the text before each tool's JSON and the text after the list. None if the
    original does not render a ChatML system turn around its tools."""
    user = [{"role": "user", "content": "Hello"}]
    system = [{"role": "system", "content": "SYSTEM_PROBE"}] + user
    try:
        as_json = tokenizer.apply_chat_template(
            user, tools=_PROBE_TOOLS, tokenize=False, chat_template="{{ tools[0] | tojson }}"
        )
        one = tokenizer.apply_chat_template(system, tools=_PROBE_TOOLS, tokenize=False)
        two = tokenizer.apply_chat_template(system, tools=_PROBE_TOOLS * 2, tokenize=False)
        none = tokenizer.apply_chat_template(user, tools=_PROBE_TOOLS, tokenize=False)
    except (TemplateError, TypeError):
        return None
    head, tail = "<|im_start|>system\nSYSTEM_PROBE", "<|im_start|>user\nHello<|im_end|>\n"
    if not (one.startswith(head) and one.endswith(tail) and as_json in one and two.count(as_json) == 2):
        return None
    first, second = two.index(as_json), two.index(as_json, two.index(as_json) + len(as_json))
    separator = two[first + len(as_json) : second]
    before = one[len(head) : one.index(as_json)]
    if not before.endswith(separator):
        return None
    prefix = before[: len(before) - len(separator)]
    suffix = one[one.index(as_json) + len(as_json) : len(one) - len(tail)]
    start = "<|im_start|>system\n"
    if not none.startswith(start) or prefix not in none:
        return None
    return {
        "default": none[len(start) : none.index(prefix)],
        "prefix": prefix,
        "separator": separator,
        "suffix": suffix,
    }


def get_training_chat_template(processing_class=None, tokenizer=None) -> str | None:
    """Gives a chat template fit for training when the model's own is not: one that marks the assistant's output (for
    `assistant_only_loss`) and renders earlier turns the same whatever follows them (for tool episodes).

    A chat template fit for training, or None if the current one already is.

    Fit means: it marks assistant output with ``{% generation %}`` (for ``assistant_only_loss``) and, if it
    renders tool calls, earlier turns render the same whatever follows them. A known model family's template
    (Llama 3, Gemma 1-3, Phi-3, Cohere, DeepSeek, GLM-4-MoE, gpt-oss, LFM2, Nemotron 3, Qwen 3 / 3.5 / VL,
    Idefics3, LLaVA-NeXT, ...; see docs/tools.md) comes back with that family's edits:
    the markers, and for Qwen 3 / 3.5 every turn's think block shown. Other ChatML templates (with or without a
    default system prompt, with or without Hermes ``<tool_call>`` tools as in Qwen 2.5) get posttrain's own
    ChatML template with the markers, built from the original's rendered pieces. Either is checked to render
    like the original on probe conversations (prompts only where the family's variant deliberately differs);
    other templates raise ValueError. `tokenizer` is a deprecated alias of `processing_class`, as in TRL.

    See docs/tools.md.
    """
    if tokenizer is not None:
        if processing_class is not None:
            raise TypeError("Pass only `processing_class`; `tokenizer` is a deprecated alias for it.")
        warnings.warn(
            "get_training_chat_template(tokenizer=...) is deprecated; pass processing_class=...",
            FutureWarning,
            stacklevel=2,
        )
        processing_class = tokenizer
    if processing_class is None:
        raise TypeError("get_training_chat_template() missing required argument: 'processing_class'")
    chat_template = processing_class.chat_template
    if chat_template is None:
        raise ValueError("The tokenizer has no chat template to make training-compatible; set one first.")
    if isinstance(chat_template, dict):  # named variants: the `default` one is what renders
        chat_template = chat_template["default"]
    tools = supports_tool_calling(processing_class)
    if has_generation_markers(chat_template) and (not tools or is_chat_template_prefix_preserving(processing_class)):
        return None
    owner = getattr(processing_class, "tokenizer", processing_class)
    known = patch_chat_template(chat_template)
    if known is not None:
        family, candidate = known
        if _renders_like(owner, candidate, with_tools=tools, patched_family=family, original=chat_template):
            return candidate
    tools_format = _tools_format(owner) if tools else None
    if not tools or tools_format is not None:
        candidate = _chatml_training_template(_default_system(owner), tools_format)
        if _renders_like(owner, candidate, with_tools=tools):
            return candidate
    raise ValueError(
        "The chat template is not training-compatible (missing prefix-preservation or `{% generation %}` markers) "
        "and patching is not supported for this template: posttrain patches the templates of known model families "
        "and ChatML templates (plain, or with Qwen 2.5-style Hermes tool calls). Add `{% generation %}` / "
        "`{% endgeneration %}` around the assistant output yourself."
    )
