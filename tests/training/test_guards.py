"""Nothing lost: a non-finite step is never applied, SIGTERM checkpoints and exits 0 with an exact resume, and
checkpoint rotation never leaves nothing complete to resume from."""

import os
import signal

import pytest
import torch
from datasets import Dataset
from transformers import TrainerCallback

from posttrain import DPOConfig, DPOTrainer, GRPOConfig, SFTConfig, SFTTrainer
from posttrain.errors import ConfigError, NonFiniteError
from posttrain.training.checkpoints import CHECKPOINT_MARKER, rotate


def _sft_data():
    return Dataset.from_list([{"prompt": f"{i} plus {i}", "completion": f" is {2 * i}"} for i in range(16)])


def _args(out, **kw):
    base = dict(
        output_dir=str(out),
        per_device_train_batch_size=4,
        learning_rate=1e-2,
        lr_scheduler_type="constant",
        use_cpu=True,
        bf16=False,
        report_to="none",
        disable_tqdm=True,
        seed=0,
        logging_steps=1,
        save_strategy="no",
    )
    return base | kw


def _params(model):
    return {n: p.detach().clone() for n, p in model.named_parameters()}


class _PoisonSteps:
    """Mixed into a trainer: the loss of the optimizer steps in `bad` (1-based) is multiplied by NaN."""

    bad: set[int] = set()

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        loss = super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        if model.training and self.state.global_step + 1 in self.bad:
            loss = loss * float("nan")
        return loss


class _Snapshots(TrainerCallback):
    def __init__(self):
        self.params = {}

    def on_step_end(self, args, state, control, model=None, **kwargs):
        self.params[state.global_step] = _params(model)


class PoisonedSFT(_PoisonSteps, SFTTrainer):
    pass


class PoisonedDPO(_PoisonSteps, DPOTrainer):
    pass


def _poisoned(kind, out, model_path, bad, **kw):
    snapshots = _Snapshots()
    if kind == "sft":
        trainer = PoisonedSFT(
            model_path, args=SFTConfig(**_args(out, **kw)), train_dataset=_sft_data(), callbacks=[snapshots]
        )
    else:
        pairs = Dataset.from_list(
            [{"prompt": f"{i} plus {i} is", "chosen": f" {2 * i}", "rejected": f" {2 * i + 1}"} for i in range(16)]
        )
        trainer = PoisonedDPO(
            model_path, args=DPOConfig(**_args(out, **kw)), train_dataset=pairs, callbacks=[snapshots]
        )
    trainer.bad = bad
    return trainer, snapshots


@pytest.mark.parametrize("kind", ["sft", "dpo"])
def test_a_nan_step_stops_the_run_before_it_is_applied(kind, tmp_path, tiny_model_path):
    trainer, snapshots = _poisoned(
        kind, tmp_path, tiny_model_path, {3}, max_steps=6, save_strategy="steps", save_steps=2
    )
    with pytest.raises(NonFiniteError, match=r"Step 3: loss nan is not finite.*checkpoint-2"):
        trainer.train()
    assert trainer.state.global_step == 2
    for name, value in _params(trainer.model).items():  # the poisoned step changed nothing
        assert torch.isfinite(value).all()
        torch.testing.assert_close(value, snapshots.params[2][name], rtol=0, atol=0)
    logged = [h for h in trainer.state.log_history if "loss" in h]
    assert len(logged) == 2 and all(torch.isfinite(torch.tensor(h["loss"])) for h in logged)


def test_skip_mode_drops_the_update_and_counts_it(tmp_path, tiny_model_path):
    trainer, snapshots = _poisoned("sft", tmp_path, tiny_model_path, {3}, max_steps=5, nonfinite_policy="skip")
    trainer.train()
    assert trainer.state.global_step == 5
    for name, value in snapshots.params[3].items():  # step 3 applied nothing
        torch.testing.assert_close(value, snapshots.params[2][name], rtol=0, atol=0)
    assert any(not torch.equal(v, snapshots.params[3][n]) for n, v in snapshots.params[4].items())
    skipped = [h["nonfinite_steps_skipped"] for h in trainer.state.log_history if "loss" in h]
    assert skipped == [0.0, 0.0, 1.0, 1.0, 1.0]


def test_skip_mode_stops_after_too_many_in_a_row(tmp_path, tiny_model_path):
    trainer, _ = _poisoned(
        "sft", tmp_path, tiny_model_path, {2, 3, 4, 5}, max_steps=6, nonfinite_policy="skip", max_nonfinite_steps=2
    )
    with pytest.raises(NonFiniteError, match=r"Step 4: .*\(3 steps in a row\).*No checkpoint"):
        trainer.train()


def test_bad_nonfinite_settings_are_refused(tmp_path):
    with pytest.raises(ConfigError, match="nonfinite_policy"):
        SFTConfig(output_dir=str(tmp_path), nonfinite_policy="ignore")
    with pytest.raises(ConfigError, match="max_nonfinite_steps"):
        SFTConfig(output_dir=str(tmp_path), max_nonfinite_steps=0)


@pytest.mark.parametrize("config_class", [SFTConfig, GRPOConfig, DPOConfig])
@pytest.mark.parametrize("learning_rate", [float("inf"), float("-inf"), float("nan"), -1e-3])
def test_a_learning_rate_that_is_not_finite_is_refused_before_training(tmp_path, config_class, learning_rate):
    """inf passes torch's optimizer check and would be applied at step 1 (the guard only sees the next step's
    non-finite gradients); nan was refused only when the optimizer was made. Both stop when the config is built."""
    with pytest.raises(ConfigError, match=r"learning_rate=.* must be a finite number >= 0"):
        config_class(output_dir=str(tmp_path), learning_rate=learning_rate, report_to="none")


class _SignalAt(TrainerCallback):
    def __init__(self, step, signum=signal.SIGTERM):
        self.step, self.signum = step, signum

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.step:
            os.kill(os.getpid(), self.signum)


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_checkpoints_the_step_and_resuming_is_exact(signum, tmp_path, tiny_model_path, capsys):
    straight = SFTTrainer(
        tiny_model_path, args=SFTConfig(**_args(tmp_path / "straight", max_steps=6)), train_dataset=_sft_data()
    )
    straight.train()

    run = tmp_path / "run"
    stopped = SFTTrainer(
        tiny_model_path,
        args=SFTConfig(**_args(run, max_steps=6)),
        train_dataset=_sft_data(),
        callbacks=[_SignalAt(3, signum)],
    )
    with pytest.raises(SystemExit) as exit_info:
        stopped.train()
    assert exit_info.value.code == 0
    assert f"stopped by {signal.Signals(signum).name} after step 3" in capsys.readouterr().out
    assert (run / "checkpoint-3" / CHECKPOINT_MARKER).exists()
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL or callable(signal.getsignal(signal.SIGTERM))
    assert signal.getsignal(signum) != stopped._on_signal  # the handlers are restored

    resumed = SFTTrainer(tiny_model_path, args=SFTConfig(**_args(run, max_steps=6)), train_dataset=_sft_data())
    resumed.train(resume_from_checkpoint=True)
    expected = _params(straight.model)
    for name, value in _params(resumed.model).items():
        torch.testing.assert_close(value, expected[name], atol=1e-6, rtol=1e-5)
    losses = [h["loss"] for h in resumed.state.log_history if "loss" in h]
    assert losses[-3:] == pytest.approx([h["loss"] for h in straight.state.log_history if "loss" in h][-3:], rel=1e-5)


def _checkpoint(root, step, complete):
    folder = root / f"checkpoint-{step}"
    folder.mkdir(parents=True)
    (folder / "model.safetensors").write_bytes(b"weights")
    if complete:
        (folder / CHECKPOINT_MARKER).write_text(str(step))


def test_rotation_keeps_the_newest_complete_checkpoint_and_drops_torn_ones_first(tmp_path):
    for step, complete in ((2, True), (4, True), (6, False), (8, True), (10, False)):
        _checkpoint(tmp_path, step, complete)
    rotate(str(tmp_path), keep=2, protected=set())
    # Torn folders go first (10 is the newest folder but cannot be resumed), then the oldest complete one;
    # 8, the newest complete checkpoint, survives.
    assert sorted(os.listdir(tmp_path)) == ["checkpoint-4", "checkpoint-8"]
    rotate(str(tmp_path), keep=1, protected=set())
    assert os.listdir(tmp_path) == ["checkpoint-8"]


def test_a_kill_during_a_save_with_save_total_limit_1_leaves_the_old_checkpoint(tmp_path, tiny_model_path):
    args = _args(tmp_path, max_steps=4, save_strategy="steps", save_steps=2, save_total_limit=1)
    trainer = SFTTrainer(tiny_model_path, args=SFTConfig(**args), train_dataset=_sft_data())
    save_model = trainer.save_model

    def killed_at_step_4(output_dir=None, _internal_call=False):
        save_model(output_dir, _internal_call)
        if trainer.state.global_step == 4:
            raise KeyboardInterrupt("killed after the weights, before the checkpoint was complete")

    trainer.save_model = killed_at_step_4
    with pytest.raises(KeyboardInterrupt):
        trainer.train()
    assert (tmp_path / "checkpoint-2" / CHECKPOINT_MARKER).exists()
    assert trainer.last_complete_checkpoint() == str(tmp_path / "checkpoint-2")
    trainer.save_model = save_model
    resumed = SFTTrainer(tiny_model_path, args=SFTConfig(**args), train_dataset=_sft_data())
    resumed.train(resume_from_checkpoint=True)
    assert sorted(p for p in os.listdir(tmp_path) if p.startswith("checkpoint-")) == ["checkpoint-4"]
    assert (tmp_path / "checkpoint-4" / CHECKPOINT_MARKER).exists()


def test_a_tracker_that_is_not_installed_is_named_before_training(tmp_path, monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    with pytest.raises(ConfigError, match=r"report_to includes 'wandb'.*pip install 'posttrain\[wandb\]'"):
        SFTConfig(output_dir=str(tmp_path), report_to=["wandb"])
    SFTConfig(output_dir=str(tmp_path), report_to="none")


def test_push_to_hub_without_the_hub_is_refused_before_training(tmp_path, monkeypatch):
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(ConfigError, match="HF_HUB_OFFLINE"):
        SFTConfig(output_dir=str(tmp_path), push_to_hub=True, report_to="none")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr("huggingface_hub.get_token", lambda: None)
    with pytest.raises(ConfigError, match="token"):
        SFTConfig(output_dir=str(tmp_path), push_to_hub=True, report_to="none")
