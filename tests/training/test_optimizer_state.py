"""Adam's moment buffers from one allocation (posttrain/training/optimizer_state.py): the same training as torch's lazy
initialisation bit for bit (parameters and optimizer state, step after step), one storage for the buffers made
before the first step, and Adam's own path for what it leaves alone."""

import copy

import pytest
import torch
from datasets import Dataset

from posttrain import SFTConfig, SFTTrainer
from posttrain.models.tiny import build_tiny_model, build_tiny_tokenizer
from posttrain.training.optimizer_state import allocate_adam_states_together


class _Net(torch.nn.Module):
    def __init__(self, dtype):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.a = torch.nn.Parameter(torch.randn(6, 5, generator=g, dtype=dtype))
        self.b = torch.nn.Parameter(torch.randn(5, generator=g, dtype=dtype))
        self.late = torch.nn.Parameter(torch.randn(5, 3, generator=g, dtype=dtype))  # no gradient before step 2

    def forward(self, x, step):
        y = torch.tanh(x @ self.a + self.b)
        return (y @ self.late).pow(2).sum() if step >= 2 else y.pow(2).sum()


def _train(net, optimizer, steps=5):
    g = torch.Generator().manual_seed(1)
    history = []
    for step in range(steps):
        optimizer.zero_grad()
        net(torch.randn(4, 6, generator=g, dtype=net.a.dtype), step).backward()
        optimizer.step()
        history.append([p.detach().clone() for p in net.parameters()])
    return history


def _same_state(got: dict, want: dict):
    assert got["param_groups"] == want["param_groups"]
    assert got["state"].keys() == want["state"].keys()
    for index, entries in want["state"].items():
        assert got["state"][index].keys() == entries.keys()
        for key, value in entries.items():
            mine = got["state"][index][key]
            assert (mine.dtype, mine.device, mine.shape) == (value.dtype, value.device, value.shape), (index, key)
            assert torch.equal(mine, value), (index, key)


@pytest.mark.parametrize(
    "cls,options,dtype",
    [
        (torch.optim.AdamW, {"fused": True}, torch.float32),
        (torch.optim.AdamW, {"foreach": True, "weight_decay": 0.1}, torch.float32),
        (torch.optim.Adam, {"foreach": False, "amsgrad": True}, torch.float32),
        (torch.optim.Adam, {"foreach": False, "maximize": True}, torch.float32),
        (torch.optim.AdamW, {"fused": True, "amsgrad": True}, torch.float64),
    ],
)
def test_same_training_as_lazy_initialisation_and_one_storage(cls, options, dtype):
    lazy_net, net = _Net(dtype), _Net(dtype)
    lazy = cls(lazy_net.parameters(), lr=0.1, **options)
    optimizer = cls(net.parameters(), lr=0.1, **options)
    assert allocate_adam_states_together(optimizer)
    for got, want in zip(_train(net, optimizer), _train(lazy_net, lazy)):
        assert all(torch.equal(a, b) for a, b in zip(got, want))
    _same_state(optimizer.state_dict(), lazy.state_dict())
    storages = {
        key: {optimizer.state[p][key].untyped_storage().data_ptr() for p in (net.a, net.b)}
        for key in optimizer.state[net.a]
        if key != "step"
    }
    assert len(set.union(*storages.values())) == 1  # every buffer made before the first step: one allocation
    late = optimizer.state[net.late]["exp_avg"].untyped_storage().data_ptr()
    assert late not in storages["exp_avg"]  # its first gradient came later: Adam made its buffers


def test_float64_default_dtype_gives_adams_step_dtype():
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        lazy_net, net = _Net(torch.float64), _Net(torch.float64)
        lazy = torch.optim.Adam(lazy_net.parameters(), lr=0.1, foreach=False)
        optimizer = torch.optim.Adam(net.parameters(), lr=0.1, foreach=False)
        allocate_adam_states_together(optimizer)
        _train(net, optimizer, steps=2), _train(lazy_net, lazy, steps=2)
        _same_state(optimizer.state_dict(), lazy.state_dict())
    finally:
        torch.set_default_dtype(previous)


def test_state_from_a_checkpoint_is_kept_and_other_optimizers_are_left_alone():
    net = _Net(torch.float32)
    source = torch.optim.AdamW(net.parameters(), lr=0.1)
    _train(net, source, steps=3)
    saved = copy.deepcopy(source.state_dict())
    resumed_net = copy.deepcopy(net)
    resumed = torch.optim.AdamW(resumed_net.parameters(), lr=0.1)
    resumed.load_state_dict(saved)
    allocate_adam_states_together(resumed)
    loaded = resumed.state[resumed_net.a]["exp_avg"]
    _train(net, source, steps=2), _train(resumed_net, resumed, steps=2)
    assert resumed.state[resumed_net.a]["exp_avg"] is loaded  # updated in place, not replaced by zeros
    _same_state(resumed.state_dict(), source.state_dict())
    assert not allocate_adam_states_together(torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9))


def test_trainer_allocates_adams_buffers_together():
    tokenizer = build_tiny_tokenizer()
    args = SFTConfig(
        output_dir="/tmp/unused",
        use_cpu=True,
        bf16=False,
        report_to="none",
        max_steps=2,
        disable_tqdm=True,
        save_strategy="no",
        per_device_train_batch_size=2,
    )
    trainer = SFTTrainer(
        build_tiny_model(tokenizer),
        processing_class=tokenizer,
        args=args,
        train_dataset=Dataset.from_list([{"text": "one two three four"}] * 4),
    )
    trainer.train()
    state = trainer.optimizer.optimizer.state if hasattr(trainer.optimizer, "optimizer") else trainer.optimizer.state
    assert len(state) == sum(p.requires_grad for p in trainer.model.parameters())
    assert len({s["exp_avg"].untyped_storage().data_ptr() for s in state.values()}) == 1
