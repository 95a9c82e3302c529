"""SFT on the real built-in SmolLM2-135M-Instruct (slow): trained-token masks on its ChatML template,
element by element; a few training steps on every dataset format; LoRA train, save, reload, generate."""

import pytest
import torch
from datasets import Dataset
from transformers import AutoModelForCausalLM

from posttrain import SFTConfig, SFTTrainer
from posttrain.data.formats import detect_format
from posttrain.data.tokenize import tokenize_example
from posttrain.models.loading import load_tokenizer

pytestmark = pytest.mark.slow

CONVERSATION = [
    {"role": "system", "content": "You answer in one short sentence."},
    {"role": "user", "content": "What is 3 + 4?"},
    {"role": "assistant", "content": "It is 7."},
    {"role": "user", "content": "And 10 times 2?"},
    {"role": "assistant", "content": "That makes 20, of course!"},
]


@pytest.fixture(scope="module")
def smollm2_tokenizer(smollm2_path):
    return load_tokenizer(smollm2_path)


def _chatml_reference(tokenizer, messages, trained_roles):
    """Token ids and mask built segment by segment: `<|im_start|>`, role, newline, content,
    `<|im_end|>`, newline. Content and its `<|im_end|>` are trained for `trained_roles`. Byte-level
    BPE never merges across a newline or a special token, so this concatenation is the tokenization
    of the whole rendered conversation."""
    ids, mask = [], []
    for message in messages:
        trained = int(message["role"] in trained_roles)
        for piece, flag in (
            ("<|im_start|>", 0),
            (message["role"], 0),
            ("\n", 0),
            (message["content"], trained),
            ("<|im_end|>", trained),
            ("\n", 0),
        ):
            piece_ids = tokenizer(piece, add_special_tokens=False)["input_ids"]
            ids += piece_ids
            mask += [flag] * len(piece_ids)
    return ids, mask


def test_assistant_only_mask_on_the_real_chatml_template(smollm2_tokenizer):
    tokenizer = smollm2_tokenizer
    example = {"messages": CONVERSATION}
    out = tokenize_example(example, tokenizer, detect_format(example.keys(), example), assistant_only_loss=True)
    ids, mask = _chatml_reference(tokenizer, CONVERSATION, {"assistant"})
    assert out["input_ids"] == ids
    assert out["completion_mask"] == mask
    assert tokenizer.decode(out["input_ids"]) == tokenizer.apply_chat_template(CONVERSATION, tokenize=False)
    trained = tokenizer.decode([t for t, m in zip(out["input_ids"], out["completion_mask"]) if m])
    assert trained == "It is 7.<|im_end|>That makes 20, of course!<|im_end|>"


def test_completion_only_mask_on_the_real_chatml_template(smollm2_tokenizer):
    tokenizer = smollm2_tokenizer
    example = {"prompt": CONVERSATION[:4], "completion": CONVERSATION[4:]}
    out = tokenize_example(example, tokenizer, detect_format(example.keys(), example))
    ids, mask = _chatml_reference(tokenizer, CONVERSATION, {"assistant"})
    earlier_turn = len(_chatml_reference(tokenizer, CONVERSATION[:4], {})[0])
    mask = [0] * earlier_turn + mask[earlier_turn:]  # the prompt's assistant turn is not trained
    assert out["input_ids"] == ids
    assert out["completion_mask"] == mask
    trained = tokenizer.decode([t for t, m in zip(out["input_ids"], out["completion_mask"]) if m])
    assert trained == "That makes 20, of course!<|im_end|>"


MAX_LENGTH = 40
FORMATS = {  # (row, extra settings, the text of its trained tokens; None: all of them)
    "text": (
        {
            "text": "The blue whale is the largest animal that has ever lived on Earth, far larger than any "
            "dinosaur. It eats tiny krill, several tons of them every day, and sings to other whales "
            "across whole oceans."
        },
        {},
        None,
    ),
    "messages": ({"messages": CONVERSATION[:3]}, {"assistant_only_loss": True}, "It is 7.<|im_end|>"),
    "prompt_completion": (
        {"prompt": "Q: Which planet is called the red planet?\nA:", "completion": " Mars."},
        {},
        " Mars.<|im_end|>",
    ),
}


def _args(tmp_path, **kw):
    base = dict(
        output_dir=str(tmp_path / "out"),
        per_device_train_batch_size=1,
        max_steps=10,
        learning_rate=1e-4,
        logging_steps=1,
        max_length=MAX_LENGTH,
        seed=0,
        use_cpu=True,
        bf16=False,
        report_to="none",
        save_strategy="no",
        disable_tqdm=True,
    )
    return SFTConfig(**{**base, **kw})


@pytest.mark.parametrize("name", list(FORMATS))
def test_sft_steps_on_every_format(tmp_path, smollm2_path, name):
    example, settings, trained_text = FORMATS[name]
    data = Dataset.from_list([example] * 4)  # one row repeated: every batch is known
    trainer = SFTTrainer(smollm2_path, args=_args(tmp_path, **settings), train_dataset=data)
    row = trainer.train_dataset[0]
    if trained_text is None:
        assert len(row["input_ids"]) == MAX_LENGTH and all(row["completion_mask"])  # truncated
    else:
        trained = [t for t, m in zip(row["input_ids"], row["completion_mask"]) if m]
        assert trainer.processing_class.decode(trained) == trained_text

    # The first step's loss is the model's own mean NLL over the trained tokens of that row.
    labels = [t if m else -100 for t, m in zip(row["input_ids"], row["completion_mask"])]
    with torch.no_grad():
        expected = trainer.model(input_ids=torch.tensor([row["input_ids"]]), labels=torch.tensor([labels])).loss
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert len(losses) == 10
    assert losses[0] == pytest.approx(expected.item(), rel=1e-5)
    assert losses[-1] < 0.5 * losses[0]


def test_lora_on_smollm2_trains_saves_reloads_generates(tmp_path, smollm2_path, smollm2_tokenizer):
    from peft import AutoPeftModelForCausalLM, LoraConfig

    data = Dataset.from_list([FORMATS["prompt_completion"][0]] * 4)
    trainer = SFTTrainer(
        smollm2_path,
        args=_args(tmp_path, max_steps=6, learning_rate=2e-3),
        train_dataset=data,
        peft_config=LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"]),
    )
    trainable = {n for n, p in trainer.model.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n for n in trainable)
    frozen_before = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if n not in trainable}
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert losses[-1] < losses[0]
    for name, value in trainer.model.named_parameters():
        if name in frozen_before:
            assert torch.equal(value, frozen_before[name]), name

    trainer.save_model(str(tmp_path / "adapter"))
    reloaded = AutoPeftModelForCausalLM.from_pretrained(str(tmp_path / "adapter")).eval()
    base = AutoModelForCausalLM.from_pretrained(smollm2_path).eval()
    prompt = smollm2_tokenizer.apply_chat_template(
        CONVERSATION[1:2], add_generation_prompt=True, return_tensors="pt", return_dict=True
    )
    trainer.model.eval()
    with torch.no_grad():
        adapted = trainer.model(**prompt).logits
        torch.testing.assert_close(reloaded(**prompt).logits, adapted)
        assert (base(**prompt).logits - adapted).abs().max() > 1e-2  # the adapter changes the model
    out = reloaded.generate(**prompt, max_new_tokens=8, do_sample=False)
    answer = smollm2_tokenizer.decode(out[0, prompt["input_ids"].shape[1] :])
    assert out.shape[1] > prompt["input_ids"].shape[1] and answer.strip()
