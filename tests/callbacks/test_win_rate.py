"""WinRateCallback: the logged win rate equals the judge's verdicts on completions recomputed independently from the
reference (initial weights, a separate ref_model, or the PEFT policy with its adapter off) and the trained policy."""

import copy

import pytest
import torch
from datasets import Dataset
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM, GenerationConfig, Trainer, TrainingArguments

from posttrain.experimental.judges import BasePairwiseJudge
from posttrain.experimental.winrate_callback import WinRateCallback

PROMPTS = ["the sky is", "one two", "a cat", "hello world", "red green", "what is"]
GEN = GenerationConfig(max_new_tokens=5, do_sample=False)


class LexicalJudge(BasePairwiseJudge):
    """Deterministic: the lexicographically larger completion wins (ties: the first). Records its calls."""

    def __init__(self):
        self.calls = []

    def judge(self, prompts, completions, shuffle_order=True, return_scores=False):
        self.calls.append((list(prompts), [list(p) for p in completions], shuffle_order))
        if return_scores:  # probability that the first is better: 0.9 when it is larger, 0.2 otherwise
            return [0.9 if a > b else 0.2 for a, b in completions]
        return [0 if a >= b else 1 for a, b in completions]


def _trainer(tmp_path, model, tokenizer, cls=Trainer, max_steps=3, **extra):
    rows = [tokenizer(t)["input_ids"][:3] for t in ("the sky is blue", "one two three", "a cat is good", "hello world")]
    eval_rows = [tokenizer(t)["input_ids"][:2] for t in PROMPTS]  # the eval loss needs tokens; the callback, prompts
    args = TrainingArguments(
        output_dir=str(tmp_path),
        max_steps=max_steps,
        per_device_train_batch_size=2,
        learning_rate=0.3,
        report_to=[],
        use_cpu=True,
        bf16=False,
        logging_steps=1,
        save_strategy="no",
        eval_strategy="steps",
        eval_steps=max_steps,
        per_device_eval_batch_size=4,
        disable_tqdm=True,
    )
    trainer = cls(
        model=model,
        args=args,
        train_dataset=Dataset.from_dict({"input_ids": rows, "labels": rows}),
        eval_dataset=Dataset.from_dict({"prompt": PROMPTS, "input_ids": eval_rows, "labels": eval_rows}),
        processing_class=tokenizer,
    )
    for key, value in extra.items():
        setattr(trainer, key, value)
    return trainer


def _greedy(model, tokenizer, prompts):
    """Each prompt's greedy completion, one prompt at a time (no padding)."""
    out = []
    model.eval()
    for prompt in prompts:
        ids = tokenizer(prompt, return_tensors="pt", add_special_tokens=False)
        with torch.no_grad():
            gen = model.generate(**ids, generation_config=GEN, pad_token_id=tokenizer.pad_token_id)
        out.append(tokenizer.decode(gen[0, ids["input_ids"].shape[1] :], skip_special_tokens=True))
    return out


def _expected_rate(ref, policy):
    return sum(p > r for r, p in zip(ref, policy)) / len(ref)


def _win_rates(trainer, key="eval_win_rate"):
    return [(h["step"], h[key]) for h in trainer.state.log_history if key in h]


def test_win_rate_against_the_initial_weights(tmp_path, tiny_model_path, fresh_tokenizer):
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path)
    initial = copy.deepcopy(model)
    trainer = _trainer(tmp_path, model, fresh_tokenizer)
    judge = LexicalJudge()
    callback = WinRateCallback(judge, trainer, generation_config=GEN, shuffle_order=False)
    trainer.add_callback(callback)
    trainer.train()
    ref, policy = _greedy(initial, fresh_tokenizer, PROMPTS), _greedy(trainer.model, fresh_tokenizer, PROMPTS)
    assert ref != policy  # training changed what the model says
    assert callback.ref_completions == ref
    assert _win_rates(trainer) == [(0, 0.0), (3, _expected_rate(ref, policy))]  # step 0: reference vs itself
    prompts, pairs, shuffle = judge.calls[-1]
    assert prompts == PROMPTS and shuffle is False
    assert pairs == [[r, p] for r, p in zip(ref, policy)]  # [reference, policy]: 1 is a policy win
    assert [row[4] for row in callback.table[-len(PROMPTS) :]] == [int(p > r) for r, p in zip(ref, policy)]


def test_win_rate_uses_the_trainers_ref_model_and_soft_scores(tmp_path, tiny_model_path, fresh_tokenizer):
    torch.manual_seed(1)
    ref_model = AutoModelForCausalLM.from_pretrained(tiny_model_path)
    with torch.no_grad():
        for p in ref_model.parameters():
            p.add_(0.5 * torch.randn_like(p))
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path)
    trainer = _trainer(tmp_path, model, fresh_tokenizer, ref_model=ref_model)
    callback = WinRateCallback(LexicalJudge(), trainer, generation_config=GEN, num_prompts=4, use_soft_judge=True)
    trainer.add_callback(callback)
    trainer.train()
    ref = _greedy(ref_model, fresh_tokenizer, PROMPTS[:4])
    policy = _greedy(trainer.model, fresh_tokenizer, PROMPTS[:4])
    assert callback.ref_completions == ref
    probs = [0.9 if r > p else 0.2 for r, p in zip(ref, policy)]  # the judge's P(reference better)
    assert _win_rates(trainer, "eval_avg_win_prob")[-1] == (3, pytest.approx(1 - sum(probs) / 4))
    assert _win_rates(trainer)[-1] == (3, sum(p <= 0.5 for p in probs) / 4)


def test_win_rate_reference_of_a_peft_policy_is_the_adapter_disabled_base(tmp_path, tiny_model_path, fresh_tokenizer):
    base = AutoModelForCausalLM.from_pretrained(tiny_model_path)
    policy = get_peft_model(copy.deepcopy(base), LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    torch.manual_seed(2)
    with torch.no_grad():  # a trained-looking adapter, so that policy and base differ
        for name, p in policy.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 2.0)
    trainer = _trainer(tmp_path, policy, fresh_tokenizer)
    callback = WinRateCallback(LexicalJudge(), trainer, generation_config=GEN, shuffle_order=False)
    trainer.add_callback(callback)
    metrics = trainer.evaluate()  # no training: the reference is made at this first evaluation
    ref, pol = _greedy(base, fresh_tokenizer, PROMPTS), _greedy(policy, fresh_tokenizer, PROMPTS)
    assert ref != pol
    assert callback.ref_completions == ref
    assert "eval_loss" in metrics and _win_rates(trainer) == [(0, _expected_rate(ref, pol))]


def test_win_rate_needs_eval_prompts(tmp_path, tiny_model_path, fresh_tokenizer):
    trainer = _trainer(tmp_path, AutoModelForCausalLM.from_pretrained(tiny_model_path), fresh_tokenizer)
    trainer.eval_dataset = None
    with pytest.raises(ValueError, match="evaluation dataset"):
        WinRateCallback(LexicalJudge(), trainer)


def test_win_rate_reads_the_prompts_of_a_tokenized_preference_eval_set(tmp_path, tiny_model_path, fresh_tokenizer):
    from posttrain.trainers.dpo import DPOConfig, DPOTrainer

    rows = [
        {
            "prompt": [{"role": "user", "content": f"the {w} is"}],
            "chosen": [{"role": "assistant", "content": " good"}],
            "rejected": [{"role": "assistant", "content": " bad"}],
        }
        for w in ("cat", "dog")
    ]
    args = DPOConfig(output_dir=str(tmp_path), report_to="none", use_cpu=True, disable_tqdm=True)
    trainer = DPOTrainer(
        AutoModelForCausalLM.from_pretrained(tiny_model_path),
        args=args,
        train_dataset=Dataset.from_list(rows),
        eval_dataset=Dataset.from_list(rows),
        processing_class=fresh_tokenizer,
    )
    assert "prompt" not in trainer.eval_dataset.column_names  # DPO keeps only token ids
    judge = LexicalJudge()
    trainer.add_callback(WinRateCallback(judge, trainer, generation_config=GEN, shuffle_order=False))
    trainer.evaluate()
    rendered = [
        fresh_tokenizer.apply_chat_template(r["prompt"], tokenize=False, add_generation_prompt=True) for r in rows
    ]
    assert judge.calls[-1][0] == rendered
    assert trainer.state.log_history[-1]["eval_win_rate"] == 0.0  # nothing trained: the policy is the reference


def test_win_rate_rises_as_dpo_learns_the_preferred_answer(tmp_path, tiny_model_path, fresh_tokenizer):
    """The learning check: DPO on 'prefer " no" over " the"' (single tokens of the tiny tokenizer), judged by whether
    a completion says " no" more often. The policy starts as the reference (win rate 0: ties go to the reference)
    and wins every prompt after 10 steps."""
    from posttrain.trainers.dpo import DPOConfig, DPOTrainer

    class SaysNo(BasePairwiseJudge):
        def judge(self, prompts, completions, shuffle_order=True):
            return [1 if b.count(" no") > a.count(" no") else 0 for a, b in completions]

    rows = [
        {"prompt": f"the {w} is", "chosen": " no", "rejected": " the"}
        for w in ("cat", "dog", "sky", "sun", "tree", "fish", "moon", "bird")
    ]
    args = DPOConfig(
        output_dir=str(tmp_path),
        per_device_train_batch_size=8,
        max_steps=10,
        learning_rate=0.1,
        report_to="none",
        use_cpu=True,
        bf16=False,
        save_strategy="no",
        eval_strategy="steps",
        eval_steps=10,
        disable_tqdm=True,
        logging_steps=10,
    )
    trainer = DPOTrainer(
        AutoModelForCausalLM.from_pretrained(tiny_model_path),
        args=args,
        train_dataset=Dataset.from_list(rows),
        eval_dataset=Dataset.from_list(rows),
        processing_class=fresh_tokenizer,
    )
    callback = WinRateCallback(SaysNo(), trainer, generation_config=GEN, shuffle_order=False)
    trainer.add_callback(callback)
    trainer.train()
    assert _win_rates(trainer) == [(0, 0.0), (10, 1.0)]
    assert all(" no" in policy and " no" not in ref for _, _, ref, policy, _ in callback.table[-8:])


def test_win_rate_table_goes_to_wandb_when_reported(tmp_path, tiny_model_path, fresh_tokenizer, monkeypatch):
    import sys
    import types

    logged = []
    fake = types.ModuleType("wandb")
    fake.run = object()
    fake.Table = lambda columns, data: (columns, data)
    fake.log = logged.append
    monkeypatch.setitem(sys.modules, "wandb", fake)
    trainer = _trainer(tmp_path, AutoModelForCausalLM.from_pretrained(tiny_model_path), fresh_tokenizer)
    trainer.args.report_to = ["wandb"]  # set after construction: the real wandb integration is not wanted here
    callback = WinRateCallback(LexicalJudge(), trainer, generation_config=GEN, num_prompts=2, shuffle_order=False)
    trainer.add_callback(callback)
    trainer.evaluate()
    columns, data = logged[-1]["win_rate_completions"]
    assert columns == ["step", "prompt", "reference_model", "policy", "winner_index"]
    assert data == [list(row) for row in callback.table]
