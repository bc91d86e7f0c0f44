"""Restore agreement at scale, simulated (docs/scale.md, "Simulated scale"): tiercel's own
`newest.agree` run by N rank threads, each with a real `KVStoreCoordinator`, over
`LatencyStore`, an in-process stand-in for torch's TCPStore that charges every call a round
trip and queues calls on one server, as a TCPStore's single server thread does.

Only two things are not tiercel's: the key-value store (simulated here), and each rank's local
view of its tiers (`SimCore`: the steps it has committed and a reader of one, which a real
restore opens from its own tiers and reads through afterwards; it costs nothing here).

The rank threads share this machine's cores (and one interpreter lock), so at large N the
measured time also holds every rank's own Python work done one after another, which a job's
ranks do at once on their own hosts: there it is an upper bound. `estimate_s` is the time of
the critical path instead: `ROUND_TRIPS` round trips, the one server's time for every call
(calls × `service`), and the combining rank's work (measured: its thread's CPU time in
`coordinator._combined`, which reads the N values and combines them).
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable

from tiercel import coordinator as coordination
from tiercel import newest

#: Round trips on the critical path of one agreement (two rounds): per round a rank's append
#: and add, then the combining rank's get and set, the others' get answered (together about
#: one more), their add out; 5 a round; then the last reader's 4 deletes.
ROUND_TRIPS = 2 * 5 + 4


class LatencyStore:
    """A torch.distributed Store's calls (append, add, set, get that waits for its key,
    delete_key), in process. Each call takes `latency` seconds of round trip, half before the
    server sees it and half after, plus `service` seconds of the one server's time, for
    which calls queue behind each other."""

    def __init__(self, latency: float = 0.001, service: float = 10e-6, timeout: float = 300.0):
        self.latency, self.service, self.timeout = latency, service, timeout
        self._cond = threading.Condition()
        self._data: dict[str, Any] = {}
        self._busy_until = 0.0
        self.ops: Counter[str] = Counter()

    def _call(self, op: str, key: str, fn: Callable[[], Any], wait: bool = False) -> Any:
        time.sleep(self.latency / 2)
        with self._cond:
            if wait and not self._cond.wait_for(lambda: key in self._data, self.timeout):
                raise TimeoutError(f"LatencyStore: get {key!r} waited {self.timeout} s")
            now = time.perf_counter()
            done = max(now, self._busy_until) + self.service
            self._busy_until = done
            self.ops[op] += 1
            out = fn()
            self._cond.notify_all()
        time.sleep(max(0.0, done - time.perf_counter()) + self.latency / 2)
        return out

    def append(self, key: str, value: bytes) -> None:
        self._call("append", key, lambda: self._data.__setitem__(key, self._data.get(key, b"") + value))

    def add(self, key: str, by: int) -> int:
        def add() -> int:
            self._data[key] = self._data.get(key, 0) + by
            return int(self._data[key])
        return int(self._call("add", key, add))

    def set(self, key: str, value: bytes) -> None:
        self._call("set", key, lambda: self._data.__setitem__(key, value))

    def get(self, key: str) -> bytes:
        return bytes(self._call("get", key, lambda: self._data[key], wait=True))

    def delete_key(self, key: str) -> bool:
        return bool(self._call("delete_key", key, lambda: self._data.pop(key, None) is not None))


class _Reader:
    def __init__(self, world_size: int, generation: str):
        self.world_size, self.generation = world_size, generation


class SimCore:
    """What `newest.agree` asks of a rank's core: its restorable steps, readers of them."""

    restore_order = ["sim"]

    def __init__(self, steps: list[int], world_size: int):
        self._steps, self._world = steps, world_size

    def restorable_steps(self) -> list[int]:
        return list(self._steps)

    def reader(self, step: int, rank: int, tier: str | None) -> _Reader:
        return _Reader(self._world, f"sim.{step}")

    def commit_record(self, tier: str, step: int) -> str:
        return f'{{"world_size": {self._world}}}'


@dataclass
class SimRank:
    """The `Store` fields `newest.agree` reads."""

    rank: int
    world_size: int
    coordinator: Any
    _core: SimCore


class _RoundsPerThread(dict[str, int]):
    """`coordinator._rounds` counts a process's rounds; here each rank is a thread, so each
    counts its own (the counts agree, as every rank makes the same calls)."""

    def __init__(self) -> None:
        super().__init__()
        self._local = threading.local()

    def _mine(self) -> dict[str, int]:
        if not hasattr(self._local, "d"):
            self._local.d = {}
        d: dict[str, int] = self._local.d
        return d

    def get(self, key: str, default: Any = None) -> Any:
        return self._mine().get(key, default)

    def __getitem__(self, key: str) -> int:
        return self._mine()[key]

    def __setitem__(self, key: str, value: int) -> None:
        self._mine()[key] = value


@dataclass
class AgreeResult:
    ranks: int
    seconds: float
    ops: int
    ops_by_kind: dict[str, int]
    steps: set[int | None] = field(default_factory=set)
    cpu_s: float = 0.0
    errors: list[str] = field(default_factory=list)
    combine_cpu_s: float = 0.0
    estimate_s: float = 0.0

    @property
    def ops_per_rank(self) -> float:
        return self.ops / self.ranks


def run(ranks: int, latency: float = 0.001, service: float = 10e-6, steps: tuple[int, ...] = (1, 2, 3),
        lacking: dict[int, int] | None = None) -> AgreeResult:
    """Every rank agrees on the newest step all have (`steps` on every rank but those that
    `lacking` maps to a step they lack): the time from all ranks starting together to the
    last one holding the answer, and the store's calls."""
    lacking = lacking or {}
    store = LatencyStore(latency, service)
    start = threading.Barrier(ranks + 1)
    ends: list[float] = [0.0] * ranks
    chosen: list[int | None] = [None] * ranks
    errors: list[str] = []

    def rank_main(r: int) -> None:
        me = SimRank(r, ranks, coordination.KVStoreCoordinator(store, r, ranks, prefix="sim"), SimCore([s for s in steps if lacking.get(r) != s], ranks))
        start.wait()
        try:
            chosen[r] = newest.agree(me, newest.Need()).step  # type: ignore[arg-type]
        except Exception as e:  # noqa: BLE001 -- reported with the run, not lost in a thread
            errors.append(f"rank {r}: {type(e).__name__}: {e}")
        ends[r] = time.perf_counter()

    combine_cpu = [0.0]
    real_combined = coordination._combined

    def timed_combined(values: Any, world_size: int, combine: Callable[[list[Any]], Any]) -> bytes:
        t = time.thread_time()
        try:
            return real_combined(values, world_size, combine)
        finally:
            combine_cpu[0] += time.thread_time() - t

    saved = coordination._rounds
    coordination._rounds = _RoundsPerThread()
    coordination._combined = timed_combined  # type: ignore[assignment]
    old_stack = threading.stack_size(256 << 10)
    try:
        threads = [threading.Thread(target=rank_main, args=(r,), daemon=True) for r in range(ranks)]
        for t in threads:
            t.start()
        cpu0 = time.process_time()
        start.wait()
        t0 = time.perf_counter()
        for t in threads:
            t.join()
        cpu = time.process_time() - cpu0
    finally:
        threading.stack_size(old_stack)
        coordination._rounds = saved
        coordination._combined = real_combined
    ops = sum(store.ops.values())
    estimate = ROUND_TRIPS * latency + ops * service + combine_cpu[0]
    return AgreeResult(ranks, max(ends) - t0, ops, dict(store.ops), set(chosen), cpu, errors[:3], combine_cpu[0], estimate)
