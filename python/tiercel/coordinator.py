"""Coordinators: how the ranks of a job agree, borrowed from the engine the job already runs.

tiercel never runs a membership service of its own. A restore asks every rank which steps it
can restore and takes the newest step all of them can; that takes one all-gather.

Every coordinator has `all_gather`. Where a caller needs only the combined answer, the
functions `all_true`, `agree`, `agree_part`, `agree_min`, `agree_max`, `broadcast` and `barrier` cost less: they use
the coordinator's own method of that name where it has one (the coordinators here do) and fall
back to `all_gather`, so a coordinator of the user's own needs only the protocol. Costs per
rank and in total, as formulas in the number of ranks: docs/scale.md.

A coordinator may also offer `counter()`: a job-wide atomic counter, `add(key, by) -> int`
(`StoreCounter`), through which the ranks' commits on a shared tier count themselves in
rather than list the step (docs/scale.md, "Commit"); `counter(coordinator)` returns it, or
None for a coordinator without one.
"""

from __future__ import annotations

import operator
import pickle
import struct
import sys
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any, Protocol

from .environment import launcher_job


class Coordinator(Protocol):
    rank: int
    world_size: int

    def all_gather(self, value: Any) -> list[Any]:
        """Every rank's `value`, indexed by rank. Collective: every rank must call it."""
        ...


class StoreCounter:
    """The job-wide counter of the commit protocol over a key-value store's atomic `add`: the
    rank whose add brings a step's count to the world size commits it (docs/scale.md,
    "Commit"). Called from the Store's background threads; `delete` removes a count once the
    step is committed (where the store can delete keys)."""

    def __init__(self, add: Callable[[str, int], int], delete: Callable[[str], Any] | None, source: str):
        self._add, self._delete, self.source = add, delete, source

    def __call__(self, key: str, by: int) -> int:
        return int(self._add(key, by))

    def delete(self, key: str) -> None:
        if self._delete is not None:
            self._delete(key)


def counter(coordinator: Coordinator | None) -> StoreCounter | None:
    """The coordinator's job-wide atomic counter (its `counter()`), or None where it has none:
    commits then list the step (O(N) requests per rank rather than O(1))."""
    make = getattr(coordinator, "counter", None)
    return make() if make is not None else None


class LocalCoordinator:
    """A job of one process."""

    rank = 0
    world_size = 1

    def all_gather(self, value: Any) -> list[Any]:
        return [value]


class TorchCoordinator:
    """torch.distributed's default process group (gloo or NCCL)."""

    def __init__(self) -> None:
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError("torch.distributed is not initialized; call init_process_group first")
        self._dist = dist
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()
        self._rounds = _default_store_rounds(self.rank, self.world_size)

    def all_gather(self, value: Any) -> list[Any]:
        out: list[Any] = [None] * self.world_size
        self._dist.all_gather_object(out, value)
        return out

    def counter(self) -> StoreCounter | None:
        """`add` of torch's default c10d store (the TCPStore the process group was made with)."""
        store = _default_store()
        if store is None:
            return None
        return StoreCounter(store.add, getattr(store, "delete_key", None), f"TorchCoordinator (rank {self.rank}): the c10d store")

    def _gloo(self) -> bool:
        return "gloo" in str(self._dist.get_backend())

    def all_gather_flags(self, flag: bool) -> list[bool]:
        """Every rank's `flag`: on a gloo group one all-gather of one byte per rank, where
        all_gather_object pickles and makes two (the sizes, then the bytes). Other backends
        (NCCL takes device tensors only) go through all_gather."""
        if not self._gloo():
            return [bool(v) for v in self.all_gather(flag)]
        import torch

        mine = torch.tensor([int(flag)], dtype=torch.uint8)
        out = [torch.empty_like(mine) for _ in range(self.world_size)]
        self._dist.all_gather(out, mine)
        return [bool(t.item()) for t in out]

    def all_true(self, flag: bool) -> bool:
        """Whether every rank's `flag` is true: on a gloo group one all-reduce of one byte,
        else a round on the job's store."""
        if not self._gloo():
            if self._rounds is not None:
                return self._rounds.all_true(flag)
            return all(bool(v) for v in self.all_gather(flag))
        import torch

        t = torch.tensor([int(bool(flag))], dtype=torch.uint8)
        self._dist.all_reduce(t, op=self._dist.ReduceOp.MIN)
        return bool(t.item())

    def __getattr__(self, name: str) -> Any:
        """`agree`, `agree_part`, `agree_min`, `agree_max`, `broadcast`, `barrier`: one round on
        the store the process group was made with (`_default_store_rounds`), so a rank sends
        and receives O(1) bytes where `all_gather_object` hands it N values. Without that
        store they are missing, and the functions below compute them from `all_gather`."""
        rounds = self.__dict__.get("_rounds")
        if name in _ROUND_METHODS and rounds is not None:
            return getattr(rounds, name)
        raise AttributeError(name)


def _default_store() -> Any:
    """The key-value store torch.distributed's default group was made with (the TCPStore of
    init_process_group, behind torch's prefix), or None: a group made without one, or a torch
    without the private call."""
    try:
        from torch.distributed.distributed_c10d import _get_default_store

        return _get_default_store()
    except Exception:  # noqa: BLE001 -- a private call of torch's: without it, the callers fall back
        return None


def _default_store_rounds(rank: int, world_size: int) -> KVStoreCoordinator | None:
    """Rounds on the default group's key-value store (`_default_store`), or None where there is
    none with the calls a round needs (a user's own store without append)."""
    store = _default_store()
    if store is None or not all(hasattr(store, m) for m in ("append", "add", "set", "get", "delete_key")):
        return None
    return KVStoreCoordinator(store, rank, world_size, prefix="tiercel-torch")


# The collectives a coordinator built on rounds has besides all_gather.
_ROUND_METHODS = frozenset({"agree", "agree_part", "agree_min", "agree_max", "broadcast", "barrier"})


def _cheap(coordinator: Coordinator, name: str) -> Any:
    """The coordinator's own way to do collective `name`, if it has one; a coordinator of the
    user's own needs only `all_gather`, which the functions below fall back to."""
    return getattr(coordinator, name, None)


def all_gather_flags(coordinator: Coordinator, flag: bool) -> list[bool]:
    """Every rank's `flag`, by the cheapest way the coordinator has. Collective."""
    fast = _cheap(coordinator, "all_gather_flags")
    return fast(flag) if fast is not None else [bool(v) for v in coordinator.all_gather(flag)]


def all_true(coordinator: Coordinator, flag: bool) -> bool:
    """Whether every rank's `flag` is true. Collective; use it rather than `all_gather_flags`
    where only the combined answer is needed (O(1) bytes per rank on a key-value store)."""
    fast = _cheap(coordinator, "all_true")
    return bool(fast(flag)) if fast is not None else all(bool(v) for v in coordinator.all_gather(flag))


def agree(coordinator: Coordinator, value: Any, combine: Callable[[list[Any]], Any]) -> Any:
    """`combine(every rank's value, by rank)`, computed once on one rank and handed to all: a
    reduction of the caller's own (the newest step in every rank's set, say) that costs every
    other rank O(1) bytes when the result is small. `combine` must be the same function on
    every rank. Collective."""
    fast = _cheap(coordinator, "agree")
    return fast(value, combine) if fast is not None else combine(coordinator.all_gather(value))


def agree_part(coordinator: Coordinator, value: Any, part: str,
               combine: Callable[[list[Any]], Mapping[str, Any]]) -> Any:
    """`combine(every rank's value, by rank)[part]`: `combine` runs once, on one rank, and
    makes one result per part name (a host's, a replica group's); each rank receives only the
    part it names (None where `combine` made none), so its bytes grow with its part, not with
    N. `combine` must be the same function on every rank; `part` may differ. Collective."""
    fast = _cheap(coordinator, "agree_part")
    return fast(value, part, combine) if fast is not None else combine(coordinator.all_gather(value)).get(part)


def agree_min(coordinator: Coordinator, value: Any) -> Any:
    """The least of every rank's `value` (comparable values: ints, tuples, ...). Collective."""
    fast = _cheap(coordinator, "agree_min")
    return fast(value) if fast is not None else min(coordinator.all_gather(value))


def agree_max(coordinator: Coordinator, value: Any) -> Any:
    """The greatest of every rank's `value`. Collective."""
    fast = _cheap(coordinator, "agree_max")
    return fast(value) if fast is not None else max(coordinator.all_gather(value))


def broadcast(coordinator: Coordinator, value: Any, root: int = 0) -> Any:
    """Rank `root`'s `value`, on every rank (the other ranks' `value` is ignored). Collective."""
    fast = _cheap(coordinator, "broadcast")
    return fast(value, root) if fast is not None else coordinator.all_gather(value)[root]


def barrier(coordinator: Coordinator) -> None:
    """Returns once every rank has called it. Collective."""
    fast = _cheap(coordinator, "barrier")
    if fast is not None:
        fast()
    else:
        coordinator.all_gather(None)


# Rounds of collectives over a key-value store, counted per process rather than per
# coordinator: a job that opens a second Store (after a restart of its loop, say) must not
# collide with the keys of the first. Every rank opens its stores in the same order, so the
# counts agree.
_rounds: dict[str, int] = {}


def _next_round(prefix: str) -> str:
    _rounds[prefix] = _rounds.get(prefix, 0) + 1
    return f"{prefix}/{_rounds[prefix]}"


# The one part of a round whose combine makes a single result (every collective but
# agree_part).
_WHOLE = ""


def _whole(combine: Callable[[list[Any]], Any]) -> Callable[[list[Any]], dict[str, Any]]:
    return lambda values: {_WHOLE: combine(values)}


def _combined(values: Iterable[tuple[int, bytes]], world_size: int,
              combine: Callable[[list[Any]], Mapping[str, Any]]) -> dict[str, bytes]:
    """What the combining rank hands back, one blob per part some rank asked for: (True, that
    part of combine(values by rank)), or (False, why) in every part, so that every rank
    raises rather than some waiting on a result that never comes. A value is pickled
    (part, pickled value): every part asked for is known before any value is loaded."""
    handed = [(rank, *pickle.loads(data)) for rank, data in values]  # (rank, part, pickled value)
    asked = {part for _, part, _ in handed}
    by_rank: dict[int, Any] = {}
    try:
        for rank, _, inner in handed:
            if rank in by_rank or not 0 <= rank < world_size:
                raise ValueError(f"a value from rank {rank} twice or outside the world of {world_size}")
            by_rank[rank] = pickle.loads(inner)
        missing = [r for r in range(world_size) if r not in by_rank]
        if missing:
            raise ValueError(f"no value from ranks {missing[:8]}")
        parts = combine([by_rank[r] for r in range(world_size)])
        return {p: pickle.dumps((True, parts.get(p))) for p in asked}
    except Exception as e:  # noqa: BLE001 -- any failure must reach every rank, not hang them
        why = pickle.dumps((False, f"{type(e).__name__}: {e}"))
        return {p: why for p in asked}


def _handed_in(value: Any, part: str) -> bytes:
    return pickle.dumps((part, pickle.dumps(value)))


def _outcome(blob: bytes, round_key: str, rank: int) -> Any:
    ok, result = pickle.loads(blob)
    if not ok:
        raise RuntimeError(
            f"coordinator round {round_key!r} (rank {rank}): {result}; every rank must make the same "
            "collective calls in the same order, and two jobs must not share a store under one prefix"
        )
    return result


class _Combining:
    """The collectives of a coordinator over a key-value store, all one round
    (`_exchange_parts`): every rank hands in its value and the part of the result it wants,
    one rank reads them all and applies `combine`, every rank reads its part (the one result,
    but in agree_part). Each rank makes O(1) store operations and one rank O(N) bytes more; a
    reduction hands the others O(1) bytes. Costs as formulas: docs/scale.md."""

    rank: int
    world_size: int

    def _exchange_parts(self, value: Any, part: str, combine: Callable[[list[Any]], Mapping[str, Any]],
                        several: bool) -> Any:
        """One round; `several`: the ranks may ask for different parts (agree_part), so the
        combining rank leaves the list of them for the one that cleans up."""
        raise NotImplementedError

    def _exchange(self, value: Any, combine: Callable[[list[Any]], Any]) -> Any:
        return self._exchange_parts(value, _WHOLE, _whole(combine), several=False)

    def agree_part(self, value: Any, part: str, combine: Callable[[list[Any]], Mapping[str, Any]]) -> Any:
        return self._exchange_parts(value, part, combine, several=True)

    def all_gather(self, value: Any) -> list[Any]:
        return self._exchange(value, list)

    def all_true(self, flag: bool) -> bool:
        return self._exchange(bool(flag), all)

    def agree(self, value: Any, combine: Callable[[list[Any]], Any]) -> Any:
        return self._exchange(value, combine)

    def agree_min(self, value: Any) -> Any:
        return self._exchange(value, min)

    def agree_max(self, value: Any) -> Any:
        return self._exchange(value, max)

    def broadcast(self, value: Any, root: int = 0) -> Any:
        return self._exchange(value if self.rank == root else None, operator.itemgetter(root))

    def barrier(self) -> None:
        self._exchange(None, lambda _: None)


# One rank's value in the appended key of a round: its rank and the length of what follows.
_FRAME = struct.Struct("<IQ")


def _frames(blob: bytes) -> Iterator[tuple[int, bytes]]:
    at = 0
    while at < len(blob):
        rank, size = _FRAME.unpack_from(blob, at)
        at += _FRAME.size
        yield rank, blob[at : at + size]
        at += size


class KVStoreCoordinator(_Combining):
    """Any torch.distributed Store (TCPStore, FileStore, HashStore, PrefixStore): append, add,
    set, get by key (`get` blocks until the key exists), usable without a process group, as
    tools and tests do.

    A round: each rank appends its value to one key and counts itself in; the rank whose count
    is the last combines the values into one key per part, of which every other rank reads
    its own; the last to count itself out deletes the round's keys. Nothing exchanged stays in the store, so
    the peer secret handed out in one (when the policy sets none) is not left where anyone who
    reaches the TCPStore could read it."""

    def __init__(self, store: Any, rank: int, world_size: int, prefix: str = "tiercel"):
        missing = [m for m in ("append", "add", "set", "get", "delete_key") if not hasattr(store, m)]
        if missing:
            raise TypeError(
                f"KVStoreCoordinator (rank {rank}): the store {type(store).__name__} has no {', '.join(missing)}; "
                "pass a torch.distributed Store (TCPStore, FileStore, HashStore, PrefixStore) of a torch whose Store has append"
            )
        self._store = store
        self.rank = rank
        self.world_size = world_size
        self._prefix = prefix

    def counter(self) -> StoreCounter:
        """The store's `add`."""
        return StoreCounter(self._store.add, self._store.delete_key, f"KVStoreCoordinator (rank {self.rank}): {type(self._store).__name__}")

    def _exchange_parts(self, value: Any, part: str, combine: Callable[[list[Any]], Mapping[str, Any]],
                        several: bool) -> Any:
        key, store = _next_round(self._prefix), self._store
        data = _handed_in(value, part)
        store.append(f"{key}/in", _FRAME.pack(self.rank, len(data)) + data)
        # Each rank appends before it counts itself in, in order on its connection: the one
        # that counts last finds every value in the key.
        if store.add(f"{key}/arrived", 1) == self.world_size:
            results = _combined(_frames(store.get(f"{key}/in")), self.world_size, combine)
            names = [f"{key}/part/{p}" for p in results]
            if several:  # for the last reader, who deletes them
                store.set(f"{key}/parts", pickle.dumps(names))
            if len(results) > 1 and hasattr(store, "multi_set"):
                store.multi_set(names, list(results.values()))
            else:
                for name, blob in zip(names, results.values()):
                    store.set(name, blob)
            result = results[part]
        else:
            result = store.get(f"{key}/part/{part}")
        # A counter, not a second round: only the last reader knows every rank has read.
        if store.add(f"{key}/read", 1) == self.world_size:
            names = pickle.loads(store.get(f"{key}/parts")) if several else [f"{key}/part/{_WHOLE}"]
            for k in ["in", "arrived", "read", *(["parts"] if several else [])]:
                store.delete_key(f"{key}/{k}")
            for name in names:
                store.delete_key(name)
        return _outcome(result, key, self.rank)


class JaxCoordinator(_Combining):
    """JAX's distributed client (after `jax.distributed.initialize`): its key-value store.

    A round: each rank sets its value under the round's directory and meets the others at a
    barrier; process 0 reads the directory (one call) and sets the combined result, which every
    other rank reads; after a second barrier process 0 deletes the round's directory (one call),
    so nothing exchanged stays in the store. `client` is the distributed client to use (default
    JAX's own), e.g. a wrapper that counts its calls."""

    def __init__(self, timeout_s: float = 300.0, client: Any = None) -> None:
        import jax
        from jax._src import distributed

        if client is None:
            client = distributed.global_state.client
        if client is None:
            raise RuntimeError("jax.distributed is not initialized; call jax.distributed.initialize first")
        self._client = client
        self.rank = jax.process_index()
        self.world_size = jax.process_count()
        self._timeout_ms = int(timeout_s * 1000)

    def counter(self) -> StoreCounter | None:
        """The distributed client's `key_value_increment` (jaxlib 0.10 has it; None before)."""
        add = getattr(self._client, "key_value_increment", None)
        if add is None:
            return None
        return StoreCounter(add, self._client.key_value_delete, f"JaxCoordinator (process {self.rank}): the distributed client")

    def _exchange_parts(self, value: Any, part: str, combine: Callable[[list[Any]], Mapping[str, Any]],
                        several: bool) -> Any:
        key = _next_round("tiercel-jax")
        client, ms = self._client, self._timeout_ms
        client.key_value_set_bytes(f"{key}/in/{self.rank}", _handed_in(value, part))
        client.wait_at_barrier(f"{key}/arrived", ms)
        if self.rank == 0:
            entries = client.key_value_dir_get_bytes(f"{key}/in")
            results = _combined(((int(k.rsplit("/", 1)[1]), v) for k, v in entries), self.world_size, combine)
            for p, blob in results.items():
                client.key_value_set_bytes(f"{key}/part/{p}", blob)
            result = results[part]
        else:
            result = client.blocking_key_value_get_bytes(f"{key}/part/{part}", ms)
        client.wait_at_barrier(f"{key}/read", ms)
        if self.rank == 0:
            client.key_value_delete(key)  # a directory: every key of the round
        return _outcome(result, key, self.rank)


def _jax_initialized() -> bool:
    jax_dist = sys.modules.get("jax._src.distributed")
    return jax_dist is not None and getattr(jax_dist.global_state, "client", None) is not None


def default_coordinator(rank: int | None, world_size: int | None) -> tuple[Coordinator | None, int, int]:
    """The coordinator of the engine in use, and this process's rank and world size.

    Order: torch.distributed if initialized; JAX's distributed client if initialized; else
    the launcher's environment (tiercel.environment: $RANK/$WORLD_SIZE as torchrun sets them,
    else $SLURM_PROCID/$SLURM_STEP_NUM_TASKS in a task of an srun step) with no coordinator
    (restores must then name their step); else a single process.
    """
    torch_dist = sys.modules.get("torch.distributed")  # only if the job already uses torch
    if torch_dist is not None:
        dist = torch_dist
        if dist.is_available() and dist.is_initialized():
            c = TorchCoordinator()
            if rank is not None and rank != c.rank or world_size is not None and world_size != c.world_size:
                raise ValueError(
                    f"rank={rank}, world_size={world_size} disagree with torch.distributed "
                    f"(rank {c.rank} of {c.world_size})"
                )
            return c, c.rank, c.world_size
    if _jax_initialized():
        j = JaxCoordinator()
        return j, j.rank, j.world_size
    rank, world_size = launcher_job(rank, world_size)
    if world_size == 1:
        return LocalCoordinator(), rank, world_size
    return None, rank, world_size
