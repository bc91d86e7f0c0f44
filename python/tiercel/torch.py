"""Checkpoints of plain PyTorch training through a tiercel Store, in two calls.

    store = tiercel.Store.open("tiercel.toml")
    start = tiercel.torch.load_state(store, model=model, optimizer=opt, scheduler=sched) or 0
    for step in range(start + 1, steps + 1):
        ...
        tiercel.torch.save_state(store, step, model=model, optimizer=opt, scheduler=sched,
                                 extra={"epoch": epoch}, dataloader=loader)

`save_state` stores what each object's `state_dict()` returns, one put per object ("model",
"optimizer", "scheduler", "dataloader", "extra") and the random number generators' states
("rng": torch's CPU generator, every initialized CUDA device's, numpy's global one and
Python's `random`). torch keys an optimizer's state by the position of each parameter in its
param groups, not by the parameter objects, so it loads into a freshly built optimizer over a
freshly built model. `load_state` calls each object's `load_state_dict()` and puts the
generators back, so a resumed run draws the same random numbers as an uninterrupted one.

For sharded models (FSDP2, DTensor, tensor parallel), use tiercel.dcp with DCP instead.
"""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch

from .errors import InvalidArgumentError, NotFoundError
from .step import SaveHandle
from .store import Store

#: The puts save_state writes, in order.
PUTS = ("model", "optimizer", "scheduler", "dataloader", "extra", "rng")


def save_state(
    store: Store,
    step: int,
    *,
    model: torch.nn.Module | None = None,
    optimizer: torch.optim.Optimizer | None = None,
    scheduler: Any = None,
    extra: dict[str, Any] | None = None,
    dataloader: Any = None,
    rng: bool = True,
) -> SaveHandle:
    """Saves the given objects' states as `step`; returns once they are in shared memory
    (the handle tells when the slower tiers have them). `dataloader`: an object with
    `state_dict()` (torchdata's StatefulDataLoader, a stateful sampler), or any value that
    says where the data stands (an index, a dict). `rng=False` leaves the generators out."""
    state: dict[str, Any] = {}
    for name, obj in (("model", model), ("optimizer", optimizer), ("scheduler", scheduler)):
        if obj is not None:
            state[name] = _state_dict(obj, name)
    if dataloader is not None:
        state["dataloader"] = dataloader.state_dict() if hasattr(dataloader, "state_dict") else dataloader
    if extra is not None:
        if not isinstance(extra, dict):
            raise InvalidArgumentError(f"extra must be a dict, got {type(extra).__name__}")
        state["extra"] = extra
    if rng:
        state["rng"] = rng_state()
    if not state:
        raise InvalidArgumentError("save_state was given nothing to save (model=, optimizer=, ...)")
    return store.save(step, state)


def load_state(
    store: Store,
    *,
    model: torch.nn.Module | None = None,
    optimizer: torch.optim.Optimizer | None = None,
    scheduler: Any = None,
    extra: dict[str, Any] | None = None,
    dataloader: Any = None,
    rng: bool = True,
    step: int | None = None,
    strict: bool = True,
) -> int | None:
    """Loads a step saved by save_state into the given objects, in place; returns the step,
    or None when there is none yet (and `step` was not given): a fresh start.

    `step` defaults to the newest step every rank can restore. `extra`: a dict that receives
    the saved extra values. `dataloader`: an object with `load_state_dict()`, or a dict that
    receives the saved value. `strict` is passed to the model's `load_state_dict`."""
    if step is None:
        # None only when this job has saved nothing; a job saved by another number of ranks
        # raises WorldSizeError (a fresh start would overwrite it).
        if store.latest_step() is None:
            return None
        saved = store.restore()  # falls back past a step damaged on every tier, with a warning
    else:
        saved = store.restore(step)
    assert store.last_restore is not None
    step = store.last_restore.step
    wanted = {"model": model, "optimizer": optimizer, "scheduler": scheduler, "dataloader": dataloader, "extra": extra}
    missing = [n for n, obj in wanted.items() if obj is not None and n not in saved]
    if rng and "rng" not in saved:
        missing.append("rng (pass rng=False to load without it)")
    if missing:
        raise NotFoundError(f"step {step} holds no {', '.join(missing)} (it has: {', '.join(sorted(saved))})")
    if model is not None:
        model.load_state_dict(saved["model"], strict=strict)
    if optimizer is not None:
        optimizer.load_state_dict(saved["optimizer"])
    if scheduler is not None:
        scheduler.load_state_dict(saved["scheduler"])
    if dataloader is not None:
        _load_into(dataloader, saved["dataloader"], "dataloader")
    if extra is not None:
        _load_into(extra, saved["extra"], "extra")
    if rng:
        set_rng_state(saved["rng"])
    return step


def rng_state() -> dict[str, Any]:
    """The states of torch's CPU generator, every initialized CUDA device's, numpy's global
    generator and Python's `random`."""
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    """Puts back what rng_state() returned."""
    torch.set_rng_state(state["torch"].clone())
    np.random.set_state(state["numpy"])
    random.setstate(state["python"])
    cuda = state.get("cuda")
    if cuda is not None and torch.cuda.is_available():
        if len(cuda) != torch.cuda.device_count():
            raise InvalidArgumentError(f"the checkpoint holds the generator states of {len(cuda)} CUDA devices, "
                                       f"this process sees {torch.cuda.device_count()}; load with rng=False")
        torch.cuda.set_rng_state_all([t.clone() for t in cuda])


def _state_dict(obj: Any, name: str) -> Any:
    if not hasattr(obj, "state_dict"):
        raise InvalidArgumentError(f"{name}= must have a state_dict() method, got {type(obj).__name__}")
    return obj.state_dict()


def _load_into(target: Any, value: Any, name: str) -> None:
    """An object with load_state_dict() loads the value; a dict receives it."""
    if hasattr(target, "load_state_dict"):
        target.load_state_dict(value)
    elif isinstance(target, dict) and isinstance(value, dict):
        target.update(value)
    else:
        raise InvalidArgumentError(
            f"{name}= must have a load_state_dict() method, or be a dict to receive the saved "
            f"{type(value).__name__}; got {type(target).__name__}"
        )


def interleave(ddp_model: Any, store: Store, process_group: Any = None) -> Any:
    """Lets checkpoint traffic make way for a DDP model's gradient all-reduces: installs a DDP
    communication hook that signals `store.traffic` busy around each bucket's all-reduce (the
    same all-reduce as DDP's default, so gradients are unchanged), and a forward pre-hook
    that marks each iteration (what `[traffic] mode = "learned"` profiles). Call it once,
    before the first forward pass (DDP takes one communication hook). Returns the forward
    pre-hook's handle (`.remove()` stops the iteration marks; the comm hook stays)."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    if not isinstance(ddp_model, torch.nn.parallel.DistributedDataParallel):
        raise InvalidArgumentError(
            f"interleave() takes a torch.nn.parallel.DistributedDataParallel model, got {type(ddp_model).__name__}"
        )
    traffic = store.traffic

    def hook(group: Any, bucket: Any) -> torch.futures.Future[torch.Tensor]:
        traffic.busy()
        try:
            fut = default_hooks.allreduce_hook(group, bucket)
        except BaseException:
            traffic.idle()
            raise

        def done(f: torch.futures.Future[torch.Tensor]) -> torch.Tensor:
            try:
                return f.value()
            finally:
                traffic.idle()

        return fut.then(done)

    # DDP checks a hook's annotations against its own classes; these (strings, under
    # `from __future__ import annotations`) are for type checkers only.
    hook.__annotations__ = {}
    ddp_model.register_comm_hook(process_group, hook)
    return ddp_model.register_forward_pre_hook(lambda _module, _args: traffic.iteration())
