"""TRL's callbacks: BEMA against a float64 reference of its update rule (and TRL's callback), completion
logging against TRL's table, the rich display, Weave's missing-package error, TRL's SyncRefModelCallback form."""

import json
import types

import pytest
import torch
from datasets import Dataset
from transformers import (
    AutoModelForCausalLM,
    GenerationConfig,
    Trainer,
    TrainerControl,
    TrainerState,
    TrainingArguments,
)

from posttrain.callbacks import (
    BEMACallback,
    LogCompletionsCallback,
    RichProgressCallback,
    SyncRefModelCallback,
    WeaveCallback,
)

try:
    import trl.trainer.callbacks as trl_callbacks
except Exception:
    trl_callbacks = None

BEMA_KW = dict(
    update_freq=2, ema_power=0.5, bias_power=0.2, lag=3, update_after=1, multiplier=1.5, min_ema_multiplier=0.3
)


def _bema_reference(
    trajectory: list[dict], update_after, update_freq, ema_power, bias_power, lag, multiplier, min_ema_multiplier
):
    """BEMA from its definition, in float64: trajectory[t] = weights after global step t (t=0: start)."""
    theta0 = ema = None
    out = {k: v.double() for k, v in trajectory[0].items()}
    for t in range(1, len(trajectory)):
        theta = {k: v.double() for k, v in trajectory[t].items()}
        if t < update_after:
            continue
        if t == update_after:
            theta0, ema = dict(theta), dict(theta)
        elif (t - update_after) % update_freq == 0:
            base = lag + multiplier * t
            beta, alpha = max(base**-ema_power, min_ema_multiplier), base**-bias_power
            ema = {k: (1 - beta) * ema[k] + beta * theta[k] for k in theta}
            out = {k: ema[k] + alpha * (theta[k] - theta0[k]) for k in theta}
    return out


def _drive(callbacks, model, steps: int, seed: int = 0):
    """Calls the callbacks as a Trainer would, with the weights moved by random 'optimizer steps'."""
    gen = torch.Generator().manual_seed(seed)
    args, control = types.SimpleNamespace(output_dir="unused"), TrainerControl()
    state = TrainerState()
    trajectory = [{k: p.detach().clone() for k, p in model.named_parameters()}]
    for cb in callbacks:
        cb.on_train_begin(args, state, control, model=model)
    for step in range(1, steps + 1):
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn(p.shape, generator=gen) * 0.1)
        trajectory.append({k: p.detach().clone() for k, p in model.named_parameters()})
        state.global_step = step
        for cb in callbacks:
            cb.on_step_end(args, state, control, model=model)
    return trajectory


def test_bema_matches_float64_reference_and_trl(tiny_model_path):
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path)
    ours = BEMACallback(**BEMA_KW)
    callbacks = [ours]
    if trl_callbacks is not None:
        callbacks.append(trl_callbacks.BEMACallback(**BEMA_KW))
    trajectory = _drive(callbacks, model, steps=9)
    expected = _bema_reference(trajectory, **BEMA_KW)
    got = dict(ours.running_model.named_parameters())
    moved = 0.0
    for name, value in expected.items():
        torch.testing.assert_close(got[name].double(), value, atol=1e-6, rtol=1e-6)
        moved = max(moved, (value - trajectory[-1][name].double()).abs().max().item())
    assert moved > 1e-3  # the average really differs from the last weights
    if trl_callbacks is not None:
        theirs = dict(callbacks[1].running_model.named_parameters())
        for name in expected:
            torch.testing.assert_close(got[name], theirs[name], atol=1e-6, rtol=1e-6)


def test_bema_before_first_update_is_the_initial_model_and_frozen_params_are_kept(tiny_model_path):
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path)
    model.model.embed_tokens.weight.requires_grad_(False)
    cb = BEMACallback(update_freq=10, update_after=2)
    trajectory = _drive([cb], model, steps=3)
    for name, p in cb.running_model.named_parameters():
        torch.testing.assert_close(p, trajectory[0][name])  # no update due yet
    assert "model.embed_tokens.weight" not in cb.param_names


@pytest.mark.parametrize(
    "kw, steps",
    [
        ({"update_freq": 2}, [2, 4, 6, 8]),
        ({"update_freq": 3}, [3, 6, 9]),
        ({"update_freq": 2, "update_after": 3}, [5, 7, 9]),
    ],
)
def test_bema_updates_through_trls_method_name_on_its_schedule(tiny_model_path, monkeypatch, kw, steps):
    # TRL's tests patch BEMACallback._update_bema_weights(step) to count the updates; the name and the steps match.
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path)
    cb = BEMACallback(**kw)
    seen = []
    monkeypatch.setattr(cb, "_update_bema_weights", seen.append)
    _drive([cb], model, steps=9)
    assert seen == steps


def _trainer(tmp_path, tiny_model_path, tokenizer, eval_rows, callbacks=(), max_steps=2):
    rows = [tokenizer(t)["input_ids"] for t in ("the sky is blue", "one two three", "a cat is good", "hello world")]
    train = Dataset.from_dict({"input_ids": rows, "labels": rows})
    args = TrainingArguments(
        output_dir=str(tmp_path),
        max_steps=max_steps,
        per_device_train_batch_size=1,
        learning_rate=5e-2,
        report_to=[],
        use_cpu=True,
        bf16=False,
        logging_steps=1,
        save_strategy="no",
        per_device_eval_batch_size=2,
    )
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path)
    return Trainer(
        model=model,
        args=args,
        train_dataset=train,
        eval_dataset=Dataset.from_dict({"prompt": eval_rows}),
        processing_class=tokenizer,
        callbacks=list(callbacks),
    )


def test_log_completions_writes_records_and_matches_trl(tmp_path, tiny_model_path, fresh_tokenizer):
    prompts = [[{"role": "user", "content": c}] for c in ("the sky is", "one two", "a cat")]
    config = GenerationConfig(max_new_tokens=4, do_sample=False)
    trainer = _trainer(tmp_path, tiny_model_path, fresh_tokenizer, prompts)
    ours = LogCompletionsCallback(trainer, generation_config=config, num_prompts=2, freq=1)
    trainer.add_callback(ours)
    if trl_callbacks is not None:
        theirs = trl_callbacks.LogCompletionsCallback(trainer, generation_config=config, num_prompts=2, freq=1)
        trainer.add_callback(theirs)
    trainer.train()
    records = [json.loads(line) for line in (tmp_path / "completions.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 1, 2, 2]
    assert records[1]["prompt"] == "<|im_start|>user\none two<|im_end|>\n<|im_start|>assistant\n"
    assert [tuple(r) for r in ours.table] == [(str(r["step"]), r["prompt"], r["completion"]) for r in records]
    # The last records are what the final model generates greedily.
    model = trainer.model.eval()
    for record in records[2:]:
        ids = fresh_tokenizer(record["prompt"], return_tensors="pt")
        out = model.generate(**ids, generation_config=config, pad_token_id=fresh_tokenizer.pad_token_id)
        assert record["completion"] == fresh_tokenizer.decode(
            out[0, ids["input_ids"].shape[1] :], skip_special_tokens=True
        )
    if trl_callbacks is not None:
        assert [tuple(r) for r in ours.table] == [tuple(r) for r in theirs.table]


def test_log_completions_needs_prompts(tmp_path, tiny_model_path, tokenizer):
    trainer = _trainer(tmp_path, tiny_model_path, tokenizer, ["x"])
    trainer.eval_dataset = None
    with pytest.raises(ValueError, match="evaluation dataset"):
        LogCompletionsCallback(trainer)
    trainer.eval_dataset = Dataset.from_dict({"input_ids": [[1, 2]]})
    with pytest.raises(ValueError, match="'prompt' column"):
        LogCompletionsCallback(trainer)


def test_rich_progress_tracks_steps_and_metrics():
    cb = RichProgressCallback()
    state, control, args = TrainerState(max_steps=3), TrainerControl(), None
    cb.on_train_begin(args, state, control)
    for step in (1, 2, 3):
        state.global_step = step
        cb.on_step_end(args, state, control)
    task = cb.training_bar.tasks[0]
    assert (task.completed, task.total) == (3, 3)
    cb.on_prediction_step(args, state, control, eval_dataloader=[0, 1])
    assert cb.evaluation_bar.tasks[0].total == 2
    cb.on_evaluate(args, state, control)
    assert cb.evaluation_task is None and not cb.evaluation_bar.tasks
    cb.on_log(args, state, control, logs={"loss": 0.5, "rewards/chosen": 1.25, "note": "x"})
    cb.on_train_end(args, state, control)
    assert cb.training_bar is None


def test_rich_progress_in_a_training_run(tmp_path, tiny_model_path, tokenizer):
    trainer = _trainer(tmp_path, tiny_model_path, tokenizer, ["x"], callbacks=[RichProgressCallback()], max_steps=2)
    assert trainer.train().global_step == 2


def test_bema_saves_its_model_after_training(tmp_path, tiny_model_path, tokenizer):
    bema = BEMACallback(update_freq=1, update_after=0)
    trainer = _trainer(tmp_path, tiny_model_path, tokenizer, ["x"], callbacks=[bema], max_steps=3)
    trainer.train()
    saved = AutoModelForCausalLM.from_pretrained(tmp_path / "bema")
    for name, p in saved.named_parameters():
        torch.testing.assert_close(p, dict(bema.running_model.named_parameters())[name])


def test_weave_without_the_package_says_how_to_install(tmp_path, tiny_model_path, tokenizer):
    import importlib.util

    if importlib.util.find_spec("weave") is not None:
        pytest.skip("weave is installed")
    with pytest.raises(ImportError, match="pip install weave"):
        WeaveCallback(_trainer(tmp_path, tiny_model_path, tokenizer, ["x"]))


def test_sync_ref_model_callback_trl_form(tiny_model_path):
    policy = AutoModelForCausalLM.from_pretrained(tiny_model_path)
    ref = AutoModelForCausalLM.from_pretrained(tiny_model_path)
    with torch.no_grad():
        for p in policy.parameters():
            p.add_(1.0)
    start = {k: p.detach().clone() for k, p in ref.named_parameters()}
    cb = SyncRefModelCallback(ref_model=ref, accelerator=None)  # TRL's form: alpha and steps from the args
    args = types.SimpleNamespace(ref_model_sync_steps=2, ref_model_mixup_alpha=0.25)
    state = TrainerState()
    for step in (1, 2):
        state.global_step = step
        cb.on_step_end(args, state, TrainerControl(), model=policy)
    policy_params = dict(policy.named_parameters())
    for name, p in ref.named_parameters():  # one sync at step 2: ref = 0.75 ref + 0.25 policy
        torch.testing.assert_close(p, 0.75 * start[name] + 0.25 * policy_params[name])
