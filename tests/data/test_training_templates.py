"""Training templates of known model families (`get_training_chat_template` patching the model's own template) and the
response parsers of their reply formats (`add_response_schema`). The model templates are the input: TRL ships copies
of them, so these tests run where TRL is installed."""

from pathlib import Path

import pytest

from posttrain.chat_template_utils import (
    add_response_schema,
    get_training_chat_template,
    is_chat_template_prefix_preserving,
    parse_response,
)

try:
    import trl

    _TEMPLATES = Path(trl.__file__).parent / "chat_templates"
except Exception:
    _TEMPLATES = None

pytestmark = pytest.mark.skipif(_TEMPLATES is None, reason="TRL's copies of the model templates are the test input")

CALL = {"type": "function", "function": {"name": "get_time", "arguments": {"city": "Paris"}}}
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_time",
            "description": "Time in a city.",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
        },
    }
]
EPISODE = [
    {"role": "user", "content": "Time in Paris?"},
    {"role": "assistant", "content": "Checking.", "tool_calls": [CALL]},
    {"role": "tool", "name": "get_time", "content": "9:00"},
    {"role": "assistant", "content": "It is nine."},
]
CHAT = [
    {"role": "user", "content": "Hi"},
    {"role": "assistant", "content": "Hello!"},
    {"role": "user", "content": "Bye"},
    {"role": "assistant", "content": "Goodbye!"},
]

# What each family's training template trains (the assistant mask's spans) on EPISODE (tool families) or CHAT.
TRAINED = {
    "qwen3": [
        '<think>\n\n</think>\n\nChecking.\n<tool_call>\n{"name": "get_time", "arguments": {"city": "Paris"}}\n'
        "</tool_call><|im_end|>\n",
        "<think>\n\n</think>\n\nIt is nine.<|im_end|>\n",
    ],
    "glm4moe": [
        "\n<think></think>\nChecking.\n<tool_call>get_time\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n"
        "</tool_call><|observation|>",
        "\n<think></think>\nIt is nine.<|user|>",
    ],
    "nemotron_3_nano": [
        "<think></think>Checking.\n<tool_call>\n<function=get_time>\n<parameter=city>\nParis\n</parameter>\n"
        "</function>\n</tool_call>\n<|im_end|>\n",
        "<think></think>It is nine.<|im_end|>\n",
    ],
    "deepseekv3": [
        "Checking.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_time\n```json\n"
        '{"city": "Paris"}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜><｜end▁of▁sentence｜>',
        "It is nine.<｜end▁of▁sentence｜>",
    ],
    "gptoss": [
        '<|start|>assistant to=functions.get_time<|channel|>commentary json<|message|>{"city": "Paris"}<|call|>',
        "<|start|>assistant<|channel|>final<|message|>It is nine.<|return|>",
    ],
    "llama3": ["Hello!<|eot_id|>", "Goodbye!<|eot_id|>"],
    "gemma": ["Hello!<end_of_turn>\n", "Goodbye!<end_of_turn>\n"],
    "cohere2": ["Hello!<|END_RESPONSE|><|END_OF_TURN_TOKEN|>", "Goodbye!<|END_RESPONSE|><|END_OF_TURN_TOKEN|>"],
}
TOOL_FAMILIES = ("qwen3", "glm4moe", "nemotron_3_nano", "deepseekv3", "gptoss")


def _model_template(tokenizer, name):
    tokenizer.bos_token = tokenizer.bos_token or tokenizer.eos_token  # Llama 3's template starts with it
    tokenizer.chat_template = (_TEMPLATES / f"{name}.jinja").read_text(encoding="utf-8")
    return tokenizer


def _trained_spans(tokenizer, messages, template):
    out = tokenizer.apply_chat_template(
        messages, chat_template=template, return_dict=True, return_assistant_tokens_mask=True
    )
    spans, current = [], []
    for token, bit in zip(out["input_ids"], out["assistant_masks"]):
        if bit:
            current.append(token)
        elif current:
            spans.append(tokenizer.decode(current))
            current = []
    return spans + ([tokenizer.decode(current)] if current else [])


def _render(tokenizer, messages, template=None, **kwargs):
    return tokenizer.apply_chat_template(messages, tokenize=False, chat_template=template, **kwargs)


@pytest.mark.parametrize("name", sorted(TRAINED))
def test_training_template_trains_exactly_the_assistant_output(fresh_tokenizer, name):
    tok = _model_template(fresh_tokenizer, name)
    training = get_training_chat_template(tok)
    messages = EPISODE if name in TOOL_FAMILIES else CHAT
    assert _trained_spans(tok, messages, training) == TRAINED[name]
    # Prompts (prefixes ending on a user or tool turn, with the generation prompt, with tools) render as before;
    # Qwen 3's training template shows the (empty) thinking of the turn before a tool result, which the original hides.
    for end in (1,) if name == "qwen3" else (1, 3):
        kwargs = {"add_generation_prompt": True, "tools": TOOLS if name in TOOL_FAMILIES else None}
        original_messages = messages[:end]
        if name == "deepseekv3":  # the original only takes JSON-string arguments
            original_messages = [dict(m) for m in original_messages]
            if end == 3:
                call = {"type": "function", "function": {"name": "get_time", "arguments": '{"city": "Paris"}'}}
                original_messages[1]["tool_calls"] = [call]
        assert _render(tok, messages[:end], training, **kwargs) == _render(tok, original_messages, **kwargs)


@pytest.mark.parametrize("name", ["nemotron_3_nano", "gptoss", "llama3", "gemma", "cohere2"])
def test_training_template_renders_whole_conversations_like_the_original(fresh_tokenizer, name):
    tok = _model_template(fresh_tokenizer, name)
    training = get_training_chat_template(tok)
    messages = EPISODE if name in TOOL_FAMILIES else CHAT
    assert _render(tok, messages, training) == _render(tok, messages)


def test_glm4moe_training_template_adds_only_the_final_stop_marker(fresh_tokenizer):
    tok = _model_template(fresh_tokenizer, "glm4moe")
    training = get_training_chat_template(tok)
    assert _render(tok, EPISODE, training) == _render(tok, EPISODE) + "<|user|>"
    assert _render(tok, EPISODE[:2], training) == _render(tok, EPISODE[:2]) + "<|observation|>"


@pytest.mark.parametrize("name", TOOL_FAMILIES)
def test_training_templates_of_tool_families_are_prefix_preserving_and_final(fresh_tokenizer, name):
    tok = _model_template(fresh_tokenizer, name)
    tok.chat_template = get_training_chat_template(tok)
    assert is_chat_template_prefix_preserving(tok)
    assert get_training_chat_template(tok) is None  # nothing left to patch


def test_a_template_of_no_known_family_is_still_refused(fresh_tokenizer):
    tok = _model_template(fresh_tokenizer, "llama3")
    tok.chat_template = tok.chat_template.replace("<|eot_id|>", "<|end|>").replace("set content", "set text")
    with pytest.raises(ValueError, match="not training-compatible"):
        get_training_chat_template(tok)


@pytest.mark.parametrize("name", ["glm4moe", "gptoss", "lfm2_2_5", "nemotron_3_nano", "nemotron_3_ultra"])
def test_response_parsers_read_back_what_the_template_renders(fresh_tokenizer, name):
    tok = add_response_schema(_model_template(fresh_tokenizer, name))
    tok.add_tokens(["<think>", "</think>"])  # single tokens, as in the real vocabularies
    second = {"type": "function", "function": {"name": "get_time", "arguments": {"city": "Rome"}}}
    reply = {"role": "assistant", "content": "", "tool_calls": [CALL] if name == "gptoss" else [CALL, second]}
    thinking = "thinking" if name in ("gptoss", "lfm2_2_5") else "reasoning_content"
    answer = {"role": "assistant", thinking: "Easy.", "content": "Nine."}
    for message in (reply, answer):
        conversation = [EPISODE[0], message]
        prefix = tok.apply_chat_template(conversation[:1], add_generation_prompt=True, return_dict=True)["input_ids"]
        ids = tok.apply_chat_template(conversation, return_dict=True)["input_ids"]
        assert parse_response(tok, ids[len(prefix) :], prefix=prefix, tools=TOOLS) == message


def _vision_chat():
    image = {"type": "image"}
    return [
        {"role": "user", "content": [image, {"type": "text", "text": "What is this?"}]},
        {"role": "assistant", "content": [{"type": "text", "text": "A cat."}]},
        {"role": "user", "content": [{"type": "text", "text": "Sure?"}]},
        {"role": "assistant", "content": [{"type": "text", "text": "Yes."}]},
    ]


VISION_TRAINED = {
    "qwen2_5_vl": ["A cat.<|im_end|>\n", "Yes.<|im_end|>\n"],
    "gemma3": ["A cat.<end_of_turn>\n", "Yes.<end_of_turn>\n"],
    "idefics3": [" A cat.<end_of_utterance>\n", " Yes.<end_of_utterance>\n"],
    "smolvlm": [" A cat.<end_of_utterance>\n", " Yes.<end_of_utterance>\n"],
}


@pytest.mark.parametrize("name", sorted(VISION_TRAINED))
def test_vision_training_templates_capture_each_turn_and_mark_the_assistant_one(fresh_tokenizer, name):
    tok = _model_template(fresh_tokenizer, name)
    training = get_training_chat_template(tok)
    chat = _vision_chat()
    assert _trained_spans(tok, chat, training) == VISION_TRAINED[name]
    assert _render(tok, chat, training) == _render(tok, chat)
    prompt = chat[:3]
    assert _render(tok, prompt, training, add_generation_prompt=True) == _render(
        tok, prompt, add_generation_prompt=True
    )


@pytest.mark.parametrize("name", ["qwen3_5_think", "qwen3_6", "qwen3_8"])
def test_qwen3_5_training_templates_show_every_think_block_and_mark_function_calls(fresh_tokenizer, name):
    tok = _model_template(fresh_tokenizer, name)
    training = get_training_chat_template(tok)
    call = (
        "<think>\n\n</think>\n\nChecking.\n\n<tool_call>\n<function=get_time>\n<parameter=city>\nParis\n</parameter>\n"
        "</function>\n</tool_call><|im_end|>\n"
    )
    assert _trained_spans(tok, EPISODE, training) == [call, "<think>\n\n</think>\n\nIt is nine.<|im_end|>\n"]
    kwargs = {"add_generation_prompt": True, "tools": TOOLS}
    assert _render(tok, EPISODE[:1], training, **kwargs) == _render(tok, EPISODE[:1], **kwargs)
    tok.chat_template = training
    assert is_chat_template_prefix_preserving(tok) and get_training_chat_template(tok) is None


@pytest.mark.parametrize(
    "name, completion, expected",
    [
        (
            "gemma4",
            '<|tool_call>call:get_time{city:<|"|>Paris<|"|>}<tool_call|>',
            {"role": "assistant", "content": "", "tool_calls": [CALL]},
        ),
        (
            "gemma4_v5",
            "<|channel>thought\nEasy.<channel|>Nine.<turn|>",
            {"role": "assistant", "reasoning_content": "Easy.", "content": "Nine."},
        ),
        (
            "deepseek_r1_distill",
            "Easy.\n</think>\n\nNine.<｜end▁of▁sentence｜>",
            {"role": "assistant", "reasoning_content": "Easy.", "content": "Nine."},
        ),
        ("deepseek_r1_distill", "Nine.<｜end▁of▁sentence｜>", {"role": "assistant", "content": "Nine."}),
    ],
)
def test_response_parsers_read_model_completions(fresh_tokenizer, name, completion, expected):
    tok = _model_template(fresh_tokenizer, name)
    markers = ["<|turn>", "<turn|>", "<|channel>", "<channel|>", "<|tool_call>", "<tool_call|>", '<|"|>', "</think>"]
    tok.add_tokens(markers + ["<｜Assistant｜>", "<｜end▁of▁sentence｜>"])  # single tokens, as in the real vocabularies
    tok = add_response_schema(tok)
    prefix = tok.apply_chat_template(EPISODE[:1], add_generation_prompt=True, return_dict=True)["input_ids"]
    ids = tok(completion, add_special_tokens=False)["input_ids"]
    assert parse_response(tok, ids, prefix=prefix, tools=TOOLS) == expected


def test_deepseek_v3_replies_are_not_parsed_as_r1_ones(fresh_tokenizer):
    with pytest.raises(ValueError, match="Unrecognized chat template"):
        add_response_schema(_model_template(fresh_tokenizer, "deepseekv3"))  # it renders tool calls R1 cannot parse


GEMMA4_CALL = '<|tool_call>call:get_time{city:<|"|>Paris<|"|>}<tool_call|>'
MUSE_CALL = (
    '<|start|>assistant to=get_time<|message|><atem:function_calls>\n<atem:invoke name="get_time">\n'
    '<atem:parameter name="city">Paris</atem:parameter>\n</atem:invoke>\n</atem:function_calls><|eot|>'
)


@pytest.mark.parametrize(
    "name, trained",
    [
        ("gemma4_v5", [GEMMA4_CALL, "Checking.It is nine.<turn|>\n"]),
        ("diffusion_gemma", [GEMMA4_CALL, "Checking.", "It is nine.<turn|>\n"]),
        ("muse_glimmer", [MUSE_CALL, "<|start|>assistant to=user<|message|>It is nine.<|eot|>"]),
    ],
)
def test_gemma4_layout_and_muse_glimmer_leave_tool_responses_untrained(fresh_tokenizer, name, trained):
    tok = _model_template(fresh_tokenizer, name)
    tok.add_tokens(["<turn|>", "<|turn>", "<|tool_call>", "<tool_call|>", "<|tool_response>", "<tool_response|>"])
    training = get_training_chat_template(tok)
    assert _trained_spans(tok, EPISODE, training) == trained
    assert _render(tok, EPISODE, training) == _render(tok, EPISODE)
    tok.chat_template = training
    assert is_chat_template_prefix_preserving(tok)
