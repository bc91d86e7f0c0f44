"""Flush on preemption: when the job is told it will be stopped (a spot reclaim, Slurm's
`--signal`, Kubernetes' grace period), the newest step in RAM goes to every tier that
persists, within the grace period, and a report says what each tier holds.

The ranks flush one step, the newest that every rank holds in RAM: a notice that comes while
the ranks are at different points of one iteration finds some of them one save ahead, and
each flushing its own newest would commit nothing (a tier commits a step once every rank's
part is there). They agree through the coordinator's counter (`_agree`), for a bounded time
and in a thread the handler does not wait on past it, so a dead rank or coordinator cannot
hold the flush; without an answer from every rank a rank flushes its own newest.

`Store.preempt(grace)` runs the flush from code (for a notice the framework receives itself,
such as a cloud metadata endpoint); the policy's `[preemption]` section installs a signal
handler at `Store.open` that runs it on a signal (docs/config.md, "Preemption").

The bytes move in the core (`Store::persist_now`: one persist per tier at the top priority,
`every` aside, every link's limits lifted); here: the deadline, the ranks a tier still lacks
at it, the report, and the signal handler with its chaining and exit."""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import time
import weakref
from dataclasses import dataclass, field
from types import FrameType
from typing import TYPE_CHECKING, Any, Callable

from .coordinator import counter as coordinator_counter

if TYPE_CHECKING:
    from .store import Store

log = logging.getLogger("tiercel")

#: The grace period of `Store.preempt()` when neither the call nor the policy gives one.
DEFAULT_GRACE = 30.0
#: Time kept back from the grace period to name the missing ranks, log the report and exit.
_MARGIN = (0.5, 0.1)  # seconds at most, share of the grace at most
#: How long the ranks wait for each other to agree on the step (a living rank answers in
#: milliseconds; the bound is for a dead one): the rest of the grace is for the bytes.
_AGREE = (2.0, 0.25)  # seconds at most, share of the grace at most


@dataclass
class TierReport:
    """What one tier that persists holds after a preemption's flush.

    `step`: the flushed step, when it is committed there (every rank's part and the commit
    record), else None. `state`: "committed", or why not: "timed out: ..." (still queued or
    running at the deadline), "waiting for ranks [..]" (this rank's part is there, not every
    other rank's), "failed: <error>", "skipped: <why>". `missing_ranks`: the ranks whose part
    of the step the tier lacked at the deadline (read from the tier with one listing)."""

    tier: str
    step: int | None
    state: str
    missing_ranks: list[int] = field(default_factory=list)

    @property
    def committed(self) -> bool:
        return self.step is not None


@dataclass
class PreemptReport:
    """What a preemption's flush did on this rank (`Store.preempt`). `step`: the step it
    flushed (None: the memory tier held no step of this rank); `tiers`: per tier that persists,
    in policy order; `seconds`: how long the flush took; `grace`: the period it had;
    `choice`: how the ranks chose the step ("the newest step all 2 ranks hold", or why this
    rank fell back to its own newest; empty for a job of one rank)."""

    rank: int
    step: int | None
    tiers: dict[str, TierReport]
    seconds: float
    grace: float
    choice: str = ""

    @property
    def ok(self) -> bool:
        """Whether the step is committed on every tier that persists."""
        return self.step is not None and all(t.committed for t in self.tiers.values())

    def __str__(self) -> str:
        if self.step is None:
            return f"rank {self.rank}: preemption: nothing to flush (no step of this rank in the memory tier)"
        head = f"rank {self.rank}: preemption flush of step {self.step} in {self.seconds:.2f} s (grace {self.grace:.1f} s)"
        if self.choice:
            head += f", {self.choice}"
        lines = [f"tier '{t.tier}': " + (f"holds step {t.step}" if t.committed else t.state) for t in self.tiers.values()]
        return head + ("; " + "; ".join(lines) if lines else "; no tier persists")


def preempt(store: Store, grace: float | None = None) -> PreemptReport:
    """The flush behind `Store.preempt` (see there)."""
    started = time.monotonic()
    policy = store._core.preemption
    if grace is None:
        grace = policy[0] if policy is not None else DEFAULT_GRACE
    if not grace > 0:
        from .errors import InvalidArgumentError

        raise InvalidArgumentError(f"rank {store.rank}: preempt(grace={grace!r}): the grace period must be above 0 seconds")
    deadline = started + grace - min(_MARGIN[0], _MARGIN[1] * grace)
    durable = [t["name"] for t in store._core.tiers() if t["persists"]]
    step, choice = _agree(store, store._core.preempt_steps(), min(_AGREE[0], _AGREE[1] * grace))
    if step is None:
        report = PreemptReport(store.rank, None, {}, time.monotonic() - started, grace, choice)
        log.warning("%s", report)
        return report
    try:
        handle = store._core.persist_now(step)
        handle.wait(max(0.0, deadline - time.monotonic()), True)
        states = dict(handle.states())
        tiers = {name: _tier_report(store, name, step, states.get(name, "pending")) for name in durable}
    finally:
        store._core.end_preempt()
    report = PreemptReport(store.rank, step, tiers, time.monotonic() - started, grace, choice)
    (log.warning if report.ok else log.error)("%s", report)
    return report


# Agreements counted per process, as the coordinator's rounds are: every rank of the job is
# flushing its stores in the same order, so the n-th agreement of each rank meets the others'.
_agreements = 0


def _agree(store: Store, held: list[int], wait: float) -> tuple[int | None, str]:
    """The step to flush, of `held` (this rank's steps in RAM, oldest first), and how it was
    chosen: the newest step every rank holds, agreed through the coordinator's job-wide
    counter. Each rank counts itself in on a key per step it holds, then on one for "here";
    once every rank is here, the newest of its own steps whose count is the world size is the
    newest all hold (every rank counted its steps before itself in), so every rank picks the
    same. No collective: a rank waits at most `wait` for the others (a dead rank never comes),
    in a daemon thread it leaves behind should the coordinator itself not answer; then, or
    with no step all hold, it flushes its own newest and says why."""
    global _agreements
    own = held[-1] if held else None
    world = store.world_size
    if world == 1:
        return own, ""
    count = coordinator_counter(store.coordinator)
    if count is None:
        return own, "this rank's newest (no coordinator counter to agree through)"
    _agreements += 1
    # The launch keeps apart the keys of a store kept across launches (a FileStore).
    key = f"tiercel-preempt/{store._launch}/{_agreements}"
    out: dict[str, Any] = {}

    def run() -> None:
        try:
            for s in held:
                count(f"{key}/held/{s}", 1)
            here = count(f"{key}/here", 1)
            end, pause = time.monotonic() + wait, 0.002
            while here < world:
                if time.monotonic() >= end:
                    out["late"] = here
                    return
                time.sleep(min(pause, max(0.0, end - time.monotonic())))
                pause = min(2 * pause, 0.05)
                here = count(f"{key}/here", 0)
            out["step"] = next((s for s in reversed(held) if count(f"{key}/held/{s}", 0) >= world), None)
        except Exception as e:  # noqa: BLE001 -- a coordinator that fails must not keep this rank from flushing
            out["error"] = e

    thread = threading.Thread(target=run, name="tiercel-preempt-agree", daemon=True)
    thread.start()
    thread.join(wait + 0.5)  # its own bound, and half a second for a store that answers slowly
    mine = "" if own is None else f" (this rank's newest: {own})"
    if "step" in out:
        if out["step"] is not None:
            return out["step"], f"the newest step all {world} ranks hold" + ("" if out["step"] == own else mine)
        return own, f"this rank's newest: no step is held by all {world} ranks"
    if "error" in out:
        return own, f"this rank's newest: agreeing on the step failed ({out['error']})"
    here = out.get("late")
    ranks = "the coordinator did not answer" if here is None else f"{here} of {world} ranks came"
    return own, f"this rank's newest: {ranks} within {wait:.2f} s to agree on the step"


def _tier_report(store: Store, tier: str, step: int, state: str) -> TierReport:
    if state == "committed":
        return TierReport(tier, step, state)
    if state in ("pending", "running"):
        return TierReport(tier, None, f"timed out: this rank's part was still {state} at the deadline")
    if state == "written":
        # This rank's part is there; the commit waits for the others. Which ones: one listing.
        try:
            have = set(store._core.step_ranks(tier, step))
        except Exception as e:  # a tier that cannot be listed now: say so, name nobody
            return TierReport(tier, None, f"not committed: waiting for other ranks (the tier could not be listed: {e})")
        missing = [r for r in range(store.world_size) if r not in have]
        if not missing:  # committed between the wait and the listing
            return TierReport(tier, step, "committed")
        return TierReport(tier, None, f"not committed: ranks {missing} had not written their part by the deadline", missing)
    return TierReport(tier, None, state)


# -- the signal handler ----------------------------------------------------------------------

Previous = Callable[[int, FrameType | None], Any] | int | None


class _Handler:
    """The handler of one signal: flushes every open store of the process that asked for it,
    then chains the handler that was installed before (called after the flush), then ends the
    process as the signal would have (`exit = true`) or returns to the training loop."""

    def __init__(self, signum: int, previous: Previous):
        self.signum = signum
        self.previous = previous
        self.stores: weakref.WeakSet[Store] = weakref.WeakSet()
        self.running = False

    def __call__(self, signum: int, frame: FrameType | None) -> None:
        name = signal.Signals(signum).name
        if self.running:  # a second notice while the first one's flush runs
            log.warning("tiercel: %s again during the preemption flush; it goes on", name)
            return
        stores = [s for s in list(self.stores) if not s.closed]
        policies = [p for p in (s._core.preemption for s in stores) if p is not None]
        exit_ = any(p[2] for p in policies)
        grace = min((p[0] for p in policies), default=DEFAULT_GRACE)
        self.running = True
        try:
            deadline = time.monotonic() + grace
            log.warning("tiercel: %s received: flushing the newest step to every tier that persists (grace %g s)", name, grace)
            for s in stores:
                try:
                    preempt(s, max(0.01, deadline - time.monotonic()))
                except Exception:  # one store's failure must not keep the others from flushing
                    log.exception("tiercel: rank %d: the preemption flush failed", s.rank)
        finally:
            self.running = False
        self.chain(signum, frame, exit_)

    def chain(self, signum: int, frame: FrameType | None, exit_: bool) -> None:
        prev = self.previous
        if callable(prev):
            prev(signum, frame)  # it decides what the signal does (raise, set a flag, exit)
            return
        if exit_ and prev in (signal.SIG_DFL, None):
            # As the signal would have had it: its default action, with its exit status.
            sys.stdout.flush()
            sys.stderr.flush()
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
            time.sleep(5)  # the signal arrives; should it not, say so rather than go on quietly
            raise SystemExit(128 + signum)
        # SIG_IGN before, or `exit = false`: back to the training loop.


_warned: set[str] = set()


def _warn_once(msg: str) -> None:
    if msg not in _warned:
        _warned.add(msg)
        log.warning("%s", msg)


def install(store: Store) -> bool:
    """Installs the handler of the store's `[preemption]` signals (none without the section).
    Main thread only: elsewhere, or for a signal this platform lacks, nothing is installed
    and one warning says so. A handler installed before is kept and called after the flush.
    True when the store's signals are handled."""
    policy = store._core.preemption
    if policy is None:
        return False
    _, names, _ = policy
    if threading.current_thread() is not threading.main_thread():
        _warn_once(
            f"tiercel: [preemption] in {store._core.policy_source} is not installed: the Store was opened outside "
            "the main thread, and only the main thread may handle signals; call store.preempt() on notice instead"
        )
        return False
    installed = True
    for name in names:
        signum = getattr(signal, name, None)
        try:
            if signum is None:
                raise ValueError(f"{name} does not exist on this platform")
            current = signal.getsignal(signum)
            if isinstance(current, _Handler):
                current.stores.add(store)
                continue
            handler = _Handler(signum, current)
            signal.signal(signum, handler)
        except (ValueError, OSError) as e:
            _warn_once(f"tiercel: [preemption] cannot handle {name} here ({e}); call store.preempt() on notice instead")
            installed = False
            continue
        if current is None:
            _warn_once(f"tiercel: [preemption]: the handler of {name} installed before was not set from Python and cannot be chained")
        handler.stores.add(store)
    return installed
