"""The background half of a DeepSpeed save, and the gate that keeps it consistent.

`engine.save_checkpoint` blocks only while DeepSpeed builds its state dicts and tiercel
flattens them (small values are taken then: scalars, pickled objects such as the loss scaler
and the lr scheduler's state). The tensor bytes are copied into shared memory afterwards, on
a thread, while training goes on (CheckFreq's and GEMINI's snapshot): forward and backward
do not write the tensors a checkpoint holds, the next parameter update does. So

- the tensors that only the optimizer's step writes (the module's parameters, the
  optimizer's own tensors: ZeRO's fp32 partitions, exp_avg, ...) are copied in the
  background, and the optimizer's step waits until that copy is done (`Gate`, installed by
  `tiercel.deepspeed.attach`); how long it waited is measured (`stall_seconds`);
- every other tensor in the state (module buffers such as BatchNorm's running statistics,
  which forward updates; tensors of the user's client_state) is copied in the blocking part.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable

from ..errors import TiercelError
from ..step import Leaf, Prepared, SaveHandle, Writer

log = logging.getLogger("tiercel.deepspeed")


#: ZeRO optimizer attributes: lists of the flat tensors its step updates.
_ZERO_FLAT = ("fp32_partitioned_groups_flat", "fp16_partitioned_groups_flat", "single_partition_of_fp32_groups",
              "bit16_groups_flat", "fp32_groups_flat_partition")


def updated_by_step(engine: Any) -> set[int]:
    """The storages (data pointers) of the tensors only the optimizer's step writes: the
    module's parameters (and ZeRO-3's partitions of them), and every tensor of the optimizer
    chain (DeepSpeed's wrapper, the torch optimizer inside it): its parameters, which are
    ZeRO's fp32 partitions, and its state."""
    import torch

    ptrs: set[int] = set()

    def add(t: Any) -> None:
        if isinstance(t, torch.Tensor) and t.numel():
            ptrs.add(t.untyped_storage().data_ptr())

    for p in engine.module.parameters():
        add(p)
        add(getattr(p, "ds_tensor", None))
    opt, seen = engine.optimizer, set()
    while opt is not None and id(opt) not in seen:
        seen.add(id(opt))
        # ZeRO's flat partitions: ZeRO-3 hands its fp32 ones to the torch optimizer only
        # during the step, so they are not among its parameters when a save runs.
        for name in _ZERO_FLAT:
            for t in getattr(opt, name, None) or []:
                add(t)
        for group in getattr(opt, "param_groups", None) or []:
            for p in group.get("params", []):
                add(p)
        state = getattr(opt, "state", None)
        if isinstance(state, dict):
            for st in state.values():
                for v in st.values() if isinstance(st, dict) else ():
                    add(v)
        opt = getattr(opt, "optimizer", None)
    return ptrs


def keeps_reference(updated: set[int]) -> Callable[[Leaf], bool]:
    """Which leaves a snapshot may copy later: tensors whose storage the step alone writes."""

    def keep(leaf: Leaf) -> bool:
        return leaf.meta.get("framework") == "torch" and leaf.obj.untyped_storage().data_ptr() in updated

    return keep


class Snapshot:
    """Writes prepared puts into a step and commits it, on the gate's thread (started once:
    starting a thread per save costs the caller milliseconds)."""

    def __init__(self, writer: Writer, puts: list[Prepared], executor: ThreadPoolExecutor):
        self.step = writer.step
        self.handle: SaveHandle | None = None
        self.error: BaseException | None = None
        self.started = time.perf_counter()
        self.seconds = 0.0  # how long the copy took, once done
        self._writer = writer
        self._puts = puts
        self._future = executor.submit(self._run)

    def _run(self) -> None:
        try:
            for p in self._puts:
                self._writer.write(p)
            self.handle = self._writer.commit()
        except BaseException as e:  # noqa: BLE001 - kept and raised on the training thread
            self.error = e
            self._writer.abort()
            log.error("tiercel: the checkpoint of step %d was not saved: %s", self.step, e)
        finally:
            self._puts = []  # the references to the live tensors go now
            self.seconds = time.perf_counter() - self.started

    def done(self) -> bool:
        return self._future.done()

    def join(self) -> float:
        """Waits for the snapshot; returns the seconds waited."""
        if self._future.done():
            return 0.0
        t0 = time.perf_counter()
        self._future.result()
        return time.perf_counter() - t0

    def raise_error(self) -> None:
        if self.error is not None:
            if isinstance(self.error, TiercelError):
                raise type(self.error)(f"the checkpoint of step {self.step} was not saved: {self.error}") from self.error
            raise self.error


class Gate:
    """Makes the optimizer's step wait for the running snapshot; measures the waits."""

    def __init__(self, on_stall: Callable[[float], None] | None = None) -> None:
        self.snapshot: Snapshot | None = None
        self._on_stall = on_stall  # told each wait's seconds (store.metrics().timings)
        self._executor: ThreadPoolExecutor | None = None
        #: Seconds the last optimizer step waited, and all of them together.
        self.last_stall_seconds = 0.0
        self.stall_seconds = 0.0
        self.stalls = 0  # steps that found a snapshot still running

    def start(self, writer: Writer, puts: list[Prepared]) -> Snapshot:
        """Starts the snapshot of a step (the previous one is done)."""
        if self._executor is None:
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tiercel-snapshot")
        self.snapshot = Snapshot(writer, puts, self._executor)
        return self.snapshot

    def close(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None

    def wait(self) -> float:
        s = self.snapshot
        if s is None:
            return 0.0
        waited = s.join()
        if waited:
            self.stalls += 1
            if self._on_stall is not None:
                self._on_stall(waited)
        self.last_stall_seconds = waited
        self.stall_seconds += waited
        return waited

    def install(self, optimizer: Any) -> None:
        """Wraps `optimizer.step` (DeepSpeed's optimizer: it updates every tensor the
        snapshot holds) so that it first waits for the snapshot."""
        if optimizer is None or getattr(optimizer.step, "_tiercel_gate", None) is self:
            return
        step = optimizer.step
        gate = self

        def gated_step(*args: Any, **kwargs: Any) -> Any:
            gate.wait()
            return step(*args, **kwargs)

        gated_step._tiercel_gate = self  # type: ignore[attr-defined]
        optimizer.step = gated_step
