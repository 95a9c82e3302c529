"""posttrain.models.utils's ZeRO-3 hook helpers and parameter listing against TRL 1.16's `trl.models.utils`, on a
stand-in for a DeepSpeed engine (the objects and methods TRL's helpers touch, recording the calls)."""

from types import SimpleNamespace

import pytest
import torch
from _trl import import_trl

from posttrain.models import utils as ours


class _Hook:
    def __init__(self, log, name):
        self.log, self.name = log, name

    def remove(self):
        self.log.append(("remove", self.name))


class _Coordinator:
    def __init__(self, log, invalid):
        self.log, self.invalid = log, invalid

    def is_invalid_trace(self):
        return self.invalid

    def _invalidate_trace(self):
        self.log.append("invalidate")


class _Module(torch.nn.Module):
    """A module under ZeRO-3: a parameter of its own, one of a child, and one registered as external."""

    def __init__(self):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(2))
        self.child = torch.nn.Linear(2, 2, bias=False)
        self.shared = torch.nn.Parameter(torch.ones(1))
        for param in (self.weight, self.child.weight, self.shared):
            param.ds_active_sub_modules = {1, 2}

    def ds_external_parameters(self):
        return [("shared_from_elsewhere", self.shared)]


def _engine(stage3=True, invalid=False, nested=True, optimizer=True):
    log = []
    offload = SimpleNamespace(
        module=_Module(),
        forward_hooks=[_Hook(log, "f1"), _Hook(log, "f2")],
        backward_hooks=[_Hook(log, "b1")],
        _register_deepspeed_module=lambda module: log.append(("register", type(module).__name__)),
    )
    if stage3:
        offload.param_coordinator = _Coordinator(log, invalid)
    if not optimizer:
        return SimpleNamespace(optimizer=None), log
    return SimpleNamespace(optimizer=SimpleNamespace(parameter_offload=offload) if nested else offload), log


def _after(engine, log):
    offload = getattr(engine.optimizer, "parameter_offload", engine.optimizer)
    actives = [sorted(p.ds_active_sub_modules) for p in offload.module.parameters()]
    return log, len(offload.forward_hooks), len(offload.backward_hooks), actives


@pytest.fixture(scope="module")
def trl_utils():
    import_trl()
    import trl.models.utils

    return trl.models.utils


@pytest.mark.parametrize("nested", [True, False])
def test_remove_hooks_as_trls(trl_utils, nested):
    mine, theirs = _engine(nested=nested), _engine(nested=nested)
    ours.remove_hooks(mine[0])
    trl_utils.remove_hooks(theirs[0])
    got = _after(*mine)
    assert got == _after(*theirs)
    assert got[0] == [("remove", "f1"), ("remove", "f2"), ("remove", "b1")] and got[1:3] == (0, 0)
    assert got[3] == [[], [], []]


@pytest.mark.parametrize("stage3, invalid", [(True, False), (True, True), (False, False)])
def test_add_hooks_as_trls(trl_utils, stage3, invalid):
    mine, theirs = _engine(stage3, invalid), _engine(stage3, invalid)
    ours.add_hooks(mine[0])
    trl_utils.add_hooks(theirs[0])
    assert mine[1] == theirs[1]
    assert mine[1] == (["invalidate"] if stage3 and not invalid else []) + [("register", "_Module")]


def test_hooks_before_the_first_step_and_without_an_optimizer(trl_utils):
    ours.remove_hooks(SimpleNamespace())  # no optimizer yet: nothing to do
    ours.add_hooks(SimpleNamespace())
    for module in (ours, trl_utils):
        with pytest.raises(RuntimeError):
            module.remove_hooks(_engine(optimizer=False)[0])


def test_parameter_listing_as_trls(trl_utils):
    module = _Module()
    for recurse in (False, True):
        got = [(name, id(p)) for name, p in ours.get_all_parameters(module, recurse)]
        assert got == [(name, id(p)) for name, p in trl_utils.get_all_parameters(module, recurse)]
        assert [id(p) for p in ours.iter_params(module, recurse)] == [pid for _, pid in got]
    assert [name for name, _ in ours.get_all_parameters(torch.nn.Linear(2, 2))] == ["weight", "bias"]


def test_lm_head_gather_as_trls(monkeypatch):
    """TRL's maybe_gather_lm_head_ctx: a null context without ZeRO-3 partitioned parameters; otherwise
    deepspeed's GatheredParameters over the partitioned ones that are not AVAILABLE, each once."""
    import deepspeed
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus
    from transformers.integrations import deepspeed as hf_deepspeed

    from posttrain.trainer.utils import maybe_gather_lm_head_ctx as ours

    import_trl()
    from trl.trainer.utils import maybe_gather_lm_head_ctx as theirs

    plain = torch.nn.Parameter(torch.zeros(2))
    assert type(ours(plain, None)) is type(theirs(plain, None))  # nullcontext, without ZeRO-3
    gathered = []
    monkeypatch.setattr(deepspeed.zero, "GatheredParameters", lambda params: gathered.append(params) or "gather")
    monkeypatch.setattr(hf_deepspeed, "is_deepspeed_zero3_enabled", lambda: True)
    weight, bias, whole = (torch.nn.Parameter(torch.zeros(1)) for _ in range(3))
    weight.ds_status, bias.ds_status, whole.ds_status = (
        ZeroParamStatus.NOT_AVAILABLE,
        ZeroParamStatus.INFLIGHT,
        ZeroParamStatus.AVAILABLE,
    )
    for fn in (ours, theirs):
        assert fn(weight, weight, None, bias, whole) == "gather"
        assert type(fn(whole, None)).__name__ == "nullcontext"
    assert [[id(p) for p in params] for params in gathered] == [[id(weight), id(bias)]] * 2
