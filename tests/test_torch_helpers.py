"""tiercel.torch: save_state / load_state for plain PyTorch training. A run resumed from a
saved step, into freshly built objects, repeats the uninterrupted run bit for bit: model,
optimizer (keyed by parameter order), scheduler, and the random generators of torch, numpy
and Python that dropout, data and augmentation draw from."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

import tiercel
import tiercel.torch

from conftest import error_of, run_python


class Position:
    """A stateful data source, as torchdata's StatefulDataLoader is one."""

    def __init__(self) -> None:
        self.index = 0

    def state_dict(self) -> dict:
        return {"index": self.index}

    def load_state_dict(self, state: dict) -> None:
        self.index = state["index"]


def build(seed: int):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.BatchNorm1d(16), torch.nn.Dropout(0.3), torch.nn.Linear(16, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    return model, opt, sched


def train(model, opt, sched, data: Position, steps: int) -> list[str]:
    """Losses as float.hex; every step draws from torch (data, dropout), numpy and random."""
    losses = []
    for _ in range(steps):
        x = torch.randn(4, 8) + float(np.random.standard_normal()) * random.random()
        data.index += 4
        loss = model(x).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        sched.step()
        losses.append(float(loss.item()).hex())
    return losses


def test_resume_repeats_the_uninterrupted_run_bit_for_bit(store):
    torch.manual_seed(0)
    np.random.seed(0)
    random.seed(0)
    model, opt, sched = build(1)
    data = Position()
    train(model, opt, sched, data, 3)
    handle = tiercel.torch.save_state(store, 3, model=model, optimizer=opt, scheduler=sched,
                                      extra={"epoch": 1, "best": 0.25}, dataloader=data)
    handle.wait(30)
    want = train(model, opt, sched, data, 3)
    want_state = {k: v.clone() for k, v in model.state_dict().items()}

    # A new process would start from scratch: other weights, other generator states.
    torch.manual_seed(99)
    np.random.seed(99)
    random.seed(99)
    model2, opt2, sched2 = build(2)
    data2, extra = Position(), {"note": "kept"}
    assert tiercel.torch.load_state(store, model=model2, optimizer=opt2, scheduler=sched2, extra=extra, dataloader=data2) == 3
    assert extra == {"note": "kept", "epoch": 1, "best": 0.25}
    assert data2.index == 12 and sched2.last_epoch == 3
    assert train(model2, opt2, sched2, data2, 3) == want
    for k, v in model2.state_dict().items():
        assert torch.equal(v, want_state[k]), k


def test_fresh_start_missing_parts_and_bad_arguments(store):
    model, opt, _ = build(0)
    assert tiercel.torch.load_state(store, model=model) is None  # nothing saved yet
    tiercel.torch.save_state(store, 1, model=model, rng=False).wait(30)
    msg = error_of(lambda: tiercel.torch.load_state(store, model=model, optimizer=opt), tiercel.NotFoundError)
    assert "step 1 holds no optimizer, rng" in msg and "it has: model" in msg
    assert tiercel.torch.load_state(store, model=model, rng=False) == 1
    position: dict = {}
    tiercel.torch.save_state(store, 2, dataloader=17, rng=False).wait(30)
    assert "dict to receive" in error_of(lambda: tiercel.torch.load_state(store, dataloader=position, rng=False),
                                         tiercel.InvalidArgumentError)
    assert "nothing to save" in error_of(lambda: tiercel.torch.save_state(store, 3, rng=False), tiercel.InvalidArgumentError)
    assert "extra must be a dict" in error_of(lambda: tiercel.torch.save_state(store, 3, extra=[1]),
                                              tiercel.InvalidArgumentError)
    with pytest.raises(tiercel.NotFoundError):
        tiercel.torch.load_state(store, model=model, step=7)


def test_importing_tiercel_does_not_import_torch():
    run_python("import sys, tiercel\nassert 'torch' not in sys.modules, 'tiercel imported torch'\n"
               "import tiercel.torch, tiercel.dcp\nassert tiercel.torch.save_state and tiercel.dcp.Writer")
