"""What the TiercelCheckpointHandlers of one process share: one Store per policy, and one
tiercel step write per Orbax step.

tiercel keeps one save per step: a second save of a step replaces the first (its ranks'
parts are never mixed). Orbax saves a step's items one handler call each, so the items of
one Orbax step must go into one tiercel step write: each item becomes one put of the same
Writer, which commits once every item's put is in. Two handlers of the same policy
therefore share one Store (two Stores of one policy in one process would be two writers of
the same steps) and the open step write.

Which items a step has: Orbax's CompositeCheckpointHandler runs every item's `async_save`
as tasks of one `asyncio.gather`, each to its end without awaiting (tiercel's does not
await). An item's `async_save` joins the step's write and schedules `close_registration` on
the running event loop: the loop runs it after the tasks already queued, i.e. after the
other items' `async_save`. Each item's commit future puts its item and arrives; the last to
arrive once registration closed commits, and every item's future returns that commit's
handle. (Orbax calls `finalize` on process 0 only, so the commit cannot wait for it.)

A later save of a step this process already committed, with an item that step does not
hold, would replace the step's other items: it is refused at once, with what to do.
"""

from __future__ import annotations

import threading
from typing import Any

from .. import kit
from ..errors import InvalidArgumentError
from ..step import SaveHandle
from ..step import Writer as StepWriter
from ..store import PolicyLike, Store

Key = tuple[Any, ...]

_lock = threading.Lock()
#: The shared Stores the handlers acquired, by key (tiercel.kit owns their lifetime).
_stores: dict[Key, Store] = {}
#: Step writes not committed yet, by (store key, step).
_open: dict[tuple[Key, int], StepWrite] = {}
#: The puts of the last committed write of each step, by (store key, step).
_committed: dict[tuple[Key, int], frozenset[str]] = {}


def _job() -> tuple[int, int]:
    """This process's place in the JAX job, as a new Store sees it (jax.distributed's)."""
    import jax

    return jax.process_index(), jax.process_count()


def store_key(store: Store) -> Key:
    """The key of a Store passed in (its owner closes it)."""
    return ("store", id(store))


def acquire(policy: PolicyLike | None) -> tuple[Key, Store]:
    """The Store of `policy` in this process (tiercel.kit.acquire: shared with every other
    handler and adapter object of the policy, opened on first use); each acquire is matched
    by one `release`."""
    store = kit.acquire(policy, job=_job())
    # By policy, not by Store: a step saved through an earlier Store of the policy (closed
    # since) is still refused a save of other items alone (see `begin`).
    key: Key = ("shared", kit.shared_key(store))
    with _lock:
        _stores[key] = store
    return key, store


def release(key: Key) -> None:
    """Lets go of the shared Store; the last holder closes it (waiting for its background
    work: persists, replication), first abandoning the step writes whose items never all
    arrived (their saves failed)."""
    with _lock:
        store = _stores.get(key)
    if store is None:
        return

    def abandon() -> None:
        with _lock:
            del _stores[key]
            unfinished = [_open.pop(k) for k in [k for k in _open if k[0] == key]]
        for write in unfinished:
            write.abort()

    kit.release(store, before_close=abandon)


class StepWrite:
    """One tiercel step being written by the items of one Orbax step (one put each, one at
    a time: a Writer writes one put at a time); committed once every registered item arrived
    and registration closed."""

    def __init__(self, key: Key, store: Store, step: int):
        self.key = key
        self.step = step
        self.puts: list[str] = []
        self.closed = False
        self._arrived: set[str] = set()
        self._writer: StepWriter | None = store.writer(step)
        self._cond = threading.Condition()
        self._handle: SaveHandle | None = None
        self._error: BaseException | None = None

    def close_registration(self) -> None:
        """Every item of the Orbax step has joined (see the module's docstring)."""
        with self._cond:
            self.closed = True
            self._commit_if_complete()

    def put(self, put: str, value: Any) -> None:
        """Copies one item into the step; a failure fails the whole step."""
        with self._cond:
            self._check()
            assert self._writer is not None
            try:
                self._writer.put(put, value)
            except BaseException as e:
                self._fail(e)
                raise

    def arrive(self, put: str, timeout: float) -> SaveHandle:
        """`put` is in; returns the step's handle once every item is in and the step is
        committed (by whichever item arrived last)."""
        with self._cond:
            self._arrived.add(put)
            self._commit_if_complete()
            if not self._cond.wait_for(lambda: self._handle is not None or self._error is not None, timeout):
                missing = sorted(set(self.puts) - self._arrived)
                self._fail(TimeoutError(f"step {self.step}: item(s) {missing} not saved after {timeout:.0f} s"
                                        + ("" if self.closed else "; Orbax never finished starting the step's items")))
            self._check()
            assert self._handle is not None
            return self._handle

    def abort(self) -> None:
        with self._cond:
            self._fail(InvalidArgumentError(f"step {self.step}: the save was abandoned (its store closed)"))

    def _commit_if_complete(self) -> None:
        if self._handle is not None or self._error is not None:
            return
        if not self.closed or self._arrived != set(self.puts):
            return
        assert self._writer is not None
        try:
            self._handle = self._writer.commit()
        except BaseException as e:
            self._fail(e)
            return
        self._writer = None
        with _lock:
            if _open.get((self.key, self.step)) is self:
                del _open[(self.key, self.step)]
            _committed[(self.key, self.step)] = frozenset(self.puts)
        self._cond.notify_all()

    def _check(self) -> None:
        if self._error is not None:
            raise InvalidArgumentError(f"step {self.step}: an item of this Orbax step failed to save ({self._error}); "
                                       "the step is not saved") from None

    def _fail(self, error: BaseException) -> None:
        if self._error is None and self._handle is None:
            self._error = error
        if self._writer is not None:
            self._writer.abort()
            self._writer = None
        with _lock:
            if _open.get((self.key, self.step)) is self:
                del _open[(self.key, self.step)]
        self._cond.notify_all()


def begin(key: Key, store: Store, step: int, put: str) -> StepWrite:
    """The write of `step` that item `put` joins: the open one while its registration is
    open, else a new one. An open write that already has `put` and never closed is left
    over from a save of the step that failed: it is aborted first."""
    with _lock:
        write = _open.get((key, step))
        if write is not None and put not in write.puts and not write.closed:
            write.puts.append(put)
            return write
        before = _committed.get((key, step))
        if before is not None and put not in before:
            raise InvalidArgumentError(
                f"step {step}: this process already saved step {step} with item(s) "
                f"{', '.join(repr(p) for p in sorted(before))} through the same tiercel policy, and a save of item "
                f"'{put}' alone would replace them (tiercel keeps one save per step): save every item of the step "
                "in one mngr.save(step, args=ocp.args.Composite(...)), or give this CheckpointManager a policy "
                "of its own (another memory root and persistent location)")
        stale = _open.pop((key, step), None)
    if stale is not None and not stale.closed:
        stale.abort()
    fresh = StepWrite(key, store, step)
    fresh.puts.append(put)
    with _lock:
        _open[(key, step)] = fresh
    return fresh
