"""The key-value coordinators at scale: O(N) store operations per collective in total and
O(1) per rank, every operation counted by a proxy that forwards to the real store (counting,
not mocking). KVStoreCoordinator at 48 ranks on one real torch TCPStore; JaxCoordinator with
three real JAX processes.

The 48 ranks are processes forked from one parent that imported torch once (an import per
rank would cost minutes of CPU on a small machine); the TCPStore server runs in pytest's
process, so the test can see that nothing exchanged is left in it. The costs asserted here
are the formulas of docs/scale.md."""

from __future__ import annotations

import json
import subprocess

import pytest

from conftest import PYTHON, child_env, make_policy
from fork_ranks import FORK_RANKS

td = pytest.importorskip("torch.distributed")

WORLD = 48
PREFIX = "scale"

WORKER = r"""
import datetime, json, os, sys, traceback
import torch.distributed as td  # once, before the fork
from tiercel import coordinator as tc

port, world, mode, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]


class Counting:
    # Forwards every call to the real store; counts calls by name and the bytes `get` returns
    # (but the list of an agree_part round's parts, which only its last reader reads to delete
    # them: O(parts) once per round).
    def __init__(self, store):
        self._store, self.calls, self.got = store, 0, 0
        self.names = []

    def __getattr__(self, name):
        real = getattr(self._store, name)

        def call(*args, **kwargs):
            self.calls += 1
            self.names.append(name)
            result = real(*args, **kwargs)
            if name == "get" and not str(args[0]).endswith("/parts"):
                self.got += len(result)
            return result

        return call


def collective(c, i, rank):
    # (name, what this rank gets, what it must get)
    if mode == "gather":
        value = {"rank": rank, "round": i, "pad": "x" * (rank % 7)}
        return "all_gather", c.all_gather(value), [{"rank": r, "round": i, "pad": "x" * (r % 7)} for r in range(world)]
    if mode == "parts":
        # Groups of 4 ranks: each rank receives its group's values only.
        got = tc.agree_part(c, (i, rank), f"group {rank // 4}", by_group)
        return "agree_part", got, [(i, r) for r in range(rank // 4 * 4, rank // 4 * 4 + 4)]
    name, run, want = [
        ("all_true", lambda: tc.all_true(c, rank != 17), False),
        ("all_true", lambda: tc.all_true(c, True), True),
        ("agree_min", lambda: tc.agree_min(c, (rank + 5) % world), 0),
        ("agree_max", lambda: tc.agree_max(c, (i, rank)), (i, world - 1)),
        ("broadcast", lambda: tc.broadcast(c, ("secret", i) if rank == 3 else None, 3), ("secret", i)),
        ("barrier", lambda: tc.barrier(c), None),
        ("agree", lambda: tc.agree(c, set(range(rank % 4, 40)), newest_common), 39),
        # A combine that fails on the combining rank raises on every rank, none waits forever.
        ("raises", lambda: raised(lambda: tc.agree_min(c, None if rank == 5 else rank)), True),
    ][i]
    return name, run(), want


def by_group(values):
    return {f"group {g}": values[4 * g : 4 * g + 4] for g in range(len(values) // 4)}


def raised(run):
    try:
        run()
    except RuntimeError as e:
        return "TypeError" in str(e) and "coordinator round 'scale/" in str(e)
    return False


def newest_common(sets):
    return max(set.intersection(*sets))


def rank_main(rank):
    real = td.TCPStore("127.0.0.1", port, world, False, timeout=datetime.timedelta(seconds=60))
    store = Counting(real)
    c = tc.KVStoreCoordinator(store, rank, world, prefix=tc_prefix)
    log = []
    for i in range(3 if mode in ("gather", "parts") else 8):
        calls, got, n = store.calls, store.got, len(store.names)
        name, have, want = collective(c, i, rank)
        log.append({"name": name, "ok": have == want, "have": repr(have)[:200], "calls": store.calls - calls,
                    "got": store.got - got, "combined": "set" in store.names[n:]})
    with open(f"{out}/{mode}-{rank}.json", "w") as f:
        json.dump(log, f)


tc_prefix = "PREFIX"
""".replace("PREFIX", PREFIX) + FORK_RANKS


def run_world(tmp_path, mode: str) -> list[list[dict]]:
    """Runs the 48 ranks once through `mode`'s collectives; per rank, per collective: its
    calls to the store, the bytes its `get`s returned, whether it combined, and whether its
    result was right. Asserts afterwards that the store holds no key of the coordinator."""
    master = td.TCPStore("127.0.0.1", 0, WORLD + 1, True, wait_for_workers=False)
    proc = subprocess.run([PYTHON, "-c", WORKER, str(master.port), str(WORLD), mode, str(tmp_path)],
                          env=child_env({"OMP_NUM_THREADS": "1"}), capture_output=True, text=True, timeout=150)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    left = [k for k in master.list_keys() if k.startswith(PREFIX)]
    assert left == [], f"the coordinator left {len(left)} keys in the store, e.g. {left[:5]}"
    return [json.loads((tmp_path / f"{mode}-{r}.json").read_text()) for r in range(WORLD)]


def check_costs(logs: list[list[dict]], got_by_others: int, parts: int = 0) -> list[tuple[str, int, int]]:
    """Per collective: its total store calls (<= 4N + 5; 4N + P + 7 with P `parts`), every
    rank's (<= 9, whatever N; the last reader's P + 5 more with parts), and the bytes read by
    every rank but the one that combined (<= `got_by_others`)."""
    costs = []
    for i in range(len(logs[0])):
        entries = [log[i] for log in logs]
        name = entries[0]["name"]
        wrong = [r for r, e in enumerate(entries) if not e["ok"]]
        assert not wrong, f"{name} #{i}: wrong result on ranks {wrong}, e.g. {entries[wrong[0]]['have']}"
        total = sum(e["calls"] for e in entries)
        busiest = max(e["calls"] for e in entries)
        costs.append((name, total, busiest))
        most = 4 * WORLD + (parts + 7 if parts else 5)
        assert total <= most, f"{name} #{i}: {total} store calls for {WORLD} ranks; O(N) is at most {most}"
        assert busiest <= 9 + (parts + 5 if parts else 0), f"{name} #{i}: a rank made {busiest} store calls"
        usual = sorted(e["calls"] for e in entries)[-3]  # but the combining rank and the last reader
        assert usual <= 4, f"{name} #{i}: ranks made {usual} store calls; O(1) per rank is 4"
        combiners = [r for r, e in enumerate(entries) if e["combined"]]
        assert len(combiners) == 1, f"{name} #{i}: ranks {combiners} combined; one must"
        read = max(e["got"] for r, e in enumerate(entries) if r not in combiners)
        assert read <= got_by_others, f"{name} #{i}: a rank that did not combine read {read} bytes (> {got_by_others})"
    return costs


def test_all_gather_costs_o_of_n_store_calls_at_48_ranks(tmp_path):
    logs = run_world(tmp_path, "gather")
    # An all-gather's result is O(N) bytes for every rank; only the calls stay O(1) per rank.
    costs = check_costs(logs, got_by_others=4000)
    print(costs)


def test_reductions_hand_each_rank_o_of_1_bytes(tmp_path):
    logs = run_world(tmp_path, "reduce")
    # The combining rank reads every value (O(N) bytes); every other rank reads one result.
    costs = check_costs(logs, got_by_others=100)
    assert [c[0] for c in costs] == ["all_true", "all_true", "agree_min", "agree_max", "broadcast", "barrier", "agree", "raises"]
    print(costs)


def test_agree_part_hands_each_rank_its_part_only(tmp_path):
    logs = run_world(tmp_path, "parts")
    # A rank receives its group of 4's values (about 100 bytes), whatever N.
    costs = check_costs(logs, got_by_others=120, parts=WORLD // 4)
    print(costs)


JAX_WORLD = 3

JAX_WORKER = r"""
import json, sys
import jax
pid, port, world, out = int(sys.argv[1]), sys.argv[2], int(sys.argv[3]), sys.argv[4]
jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=world, process_id=pid)
from jax._src import distributed
from tiercel import coordinator as tc


class Counting:
    # Forwards every call to JAX's real distributed client and counts it.
    def __init__(self, client):
        self._client, self.calls = client, 0

    def __getattr__(self, name):
        real = getattr(self._client, name)

        def call(*args, **kwargs):
            self.calls += 1
            return real(*args, **kwargs)

        return call


def by_parity(values):
    return {f"p{k}": [v for v in values if v % 2 == k] for k in (0, 1)}


real = distributed.global_state.client
client = Counting(real)
c = tc.JaxCoordinator(timeout_s=60, client=client)
cases = [
    ("all_gather", lambda: c.all_gather({"pid": pid}), [{"pid": p} for p in range(world)]),
    ("all_gather", lambda: c.all_gather(b"x" * pid), [b"x" * p for p in range(world)]),
    ("all_true", lambda: tc.all_true(c, pid != 1), False),
    ("agree_min", lambda: tc.agree_min(c, (pid + 1) % world), 0),
    ("agree_max", lambda: tc.agree_max(c, pid), world - 1),
    ("broadcast", lambda: tc.broadcast(c, "secret" if pid == 2 else None, 2), "secret"),
    ("barrier", lambda: tc.barrier(c), None),
    ("agree", lambda: tc.agree(c, {pid, 7, 9 - pid}, lambda sets: sorted(set.intersection(*sets))), [7]),
    # Each process receives its part only: the values of the processes of its parity.
    ("agree_part", lambda: tc.agree_part(c, pid, f"p{pid % 2}", by_parity), [p for p in range(world) if p % 2 == pid % 2]),
]
log = []
for name, run, want in cases:
    before = client.calls
    have = run()
    log.append({"name": name, "ok": have == want, "have": repr(have), "calls": client.calls - before})
# Process 0 deletes a round after its last barrier: by now nothing exchanged may be left.
left = real.key_value_dir_get_bytes("tiercel-jax") if pid == 0 else []
json.dump({"log": log, "left": [k for k, _ in left]}, open(f"{out}/jax-{pid}.json", "w"))
jax.distributed.shutdown()
"""


def test_jax_coordinator_collectives_in_o_of_n_calls(tmp_path):
    """Three real JAX processes (jax.distributed on 127.0.0.1): every collective right, O(1)
    calls to JAX's client per process, nothing left in its key-value store."""
    pytest.importorskip("jax")
    from test_multirank import free_port

    port = free_port()
    env = child_env({"JAX_PLATFORMS": "cpu", "OMP_NUM_THREADS": "1"})
    procs = [
        subprocess.Popen([PYTHON, "-c", JAX_WORKER, str(p), str(port), str(JAX_WORLD), str(tmp_path)], env=env,
                         stdout=open(tmp_path / f"jax-{p}.log", "w"), stderr=subprocess.STDOUT)
        for p in range(JAX_WORLD)
    ]
    try:
        for p in procs:
            p.wait(120)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    logs = "\n".join((tmp_path / f"jax-{p}.log").read_text()[-3000:] for p in range(JAX_WORLD))
    assert all(p.returncode == 0 for p in procs), logs
    results = [json.loads((tmp_path / f"jax-{p}.json").read_text()) for p in range(JAX_WORLD)]
    assert results[0]["left"] == [], f"keys left in JAX's store: {results[0]['left']}"
    for i in range(len(results[0]["log"])):
        entries = [r["log"][i] for r in results]
        name = entries[0]["name"]
        assert all(e["ok"] for e in entries), f"{name}: wrong results {[e['have'] for e in entries]}"
        calls = [e["calls"] for e in entries]
        # Process 0: set, barrier, one directory read, a set per part (one but in
        # agree_part), barrier, one directory delete; the others: set, barrier, get, barrier.
        # 4N + 2 in total (4N + 1 + parts).
        parts = 2 if name == "agree_part" else 1
        assert calls == [5 + parts] + [4] * (JAX_WORLD - 1), f"{name}: store calls per process {calls}"


TORCH_WORKER = r"""
import json, sys
import torch.distributed as dist
from tiercel import coordinator as tc
rank, port, out = int(sys.argv[1]), sys.argv[2], sys.argv[3]
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
c = tc.TorchCoordinator()
got = {
    "all_true": [tc.all_true(c, rank != 1), tc.all_true(c, True)],
    "agree_min": tc.agree_min(c, 5 - rank),
    "agree_max": tc.agree_max(c, 5 - rank),
    "broadcast": tc.broadcast(c, "from 1" if rank == 1 else None, 1),
    "barrier": tc.barrier(c),
    "agree": tc.agree(c, {rank, 3}, lambda sets: sorted(set.intersection(*sets))),
    "agree_part": tc.agree_part(c, rank * 10, f"r{rank}", lambda vs: {"r0": vs[1], "r1": vs[0]}),
    # The rounds above ran on the process group's own store, not all_gather_object.
    "rounds": type(c._rounds).__name__,
}
json.dump(got, open(f"{out}/torch-{rank}.json", "w"))
dist.destroy_process_group()
"""


def test_torch_coordinator_reductions_on_gloo(tmp_path):
    """TorchCoordinator's one-byte all-reduce for `all_true`, and its other reductions as
    rounds on the process group's own store (O(1) bytes per rank), on a real gloo group of
    two processes."""
    from test_multirank import free_port

    port = free_port()
    procs = [subprocess.Popen([PYTHON, "-c", TORCH_WORKER, str(r), str(port), str(tmp_path)],
                              env=child_env({"OMP_NUM_THREADS": "1"}), stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for r in range(2)]
    try:
        outs = [p.communicate(timeout=120)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert all(p.returncode == 0 for p in procs), "\n".join(o[-3000:] for o in outs)
    want = {"all_true": [False, True], "agree_min": 4, "agree_max": 5, "broadcast": "from 1", "barrier": None,
            "agree": [3], "rounds": "KVStoreCoordinator"}
    for r in range(2):
        assert json.loads((tmp_path / f"torch-{r}.json").read_text()) == {**want, "agree_part": [10, 0][r]}


AGREE_WORKER = r"""
import datetime, json, os, sys, traceback
import numpy as np
import torch.distributed as td  # once, before the fork
import tiercel
from tiercel import coordinator as tc

port, world, policy, out = int(sys.argv[1]), int(sys.argv[2]), json.loads(sys.argv[3]), sys.argv[4]


class Counting:
    # Forwards every call to the real store; notes, in order, each `get` and the bytes it
    # returned: one per round per rank, a round's result ("out": its part, all that a rank
    # that did not combine receives) or its "in" key (every rank's value: the combining rank).
    def __init__(self, store):
        self._store, self.gets = store, []

    def __getattr__(self, name):
        real = getattr(self._store, name)

        def call(*args, **kwargs):
            result = real(*args, **kwargs)
            if name == "get":
                self.gets.append(("out" if "/part/" in str(args[0]) else str(args[0]).rsplit("/", 1)[1], len(result)))
            return result

        return call


def rank_main(rank):
    real = td.TCPStore("127.0.0.1", port, world, False, timeout=datetime.timedelta(seconds=60))
    counting = Counting(real)
    with tiercel.Store(policy, coordinator=tc.KVStoreCoordinator(counting, rank, world, prefix=f"agree{world}")) as s:
        for step in (1, 2, 3):
            s.save(step, {"x": np.full(4, rank)}).wait(60, commit=True)
        tc.barrier(s.coordinator)
        counting.gets = []
        got = {"newest": s.latest_step(), "gets": list(counting.gets)}
        tc.barrier(s.coordinator)
    with open(f"{out}/agree{world}-{rank}.json", "w") as f:
        json.dump(got, f)


""" + FORK_RANKS


def agree_at(tmp_path, shm_root, world: int) -> list[dict]:
    """`world` ranks (processes) save steps 1-3 to a memory tier through a KVStoreCoordinator on
    a real TCPStore, then agree on the newest step; per rank the step and its `get`s during
    the agreement, per round ("in" or "out", bytes)."""
    master = td.TCPStore("127.0.0.1", 0, world + 1, True, wait_for_workers=False)
    policy = json.dumps(make_policy(shm_root / f"world{world}", None))
    proc = subprocess.run([PYTHON, "-c", AGREE_WORKER, str(master.port), str(world), policy, str(tmp_path)],
                          env=child_env({"OMP_NUM_THREADS": "1"}), capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return [json.loads((tmp_path / f"agree{world}-{r}.json").read_text()) for r in range(world)]


def test_step_agreement_hands_each_rank_the_same_bytes_whatever_the_world_size(tmp_path, shm_root):
    """Restore agreement (newest.agree, through `Store.latest_step`) is a reduction: a rank
    that does not combine receives the combined result, the same bytes at 2 ranks as at 6,
    where an all-gather of the ranks' steps and reports hands each rank N of them."""
    sizes = {}
    for world in (2, 6):
        got = agree_at(tmp_path, shm_root, world)
        assert [g["newest"] for g in got] == [3] * world, got
        rounds = {len(g["gets"]) for g in got}
        assert len(rounds) == 1, f"{world} ranks: the ranks took part in different numbers of rounds: {got}"
        # Per round, the bytes each rank that did not combine it read: one size, its result's.
        sizes[world] = [sorted({g["gets"][i][1] for g in got if g["gets"][i][0] == "out"}) for i in range(rounds.pop())]
        assert all(len(s) == 1 for s in sizes[world]), f"{world} ranks: result sizes per round {sizes[world]}"
    assert sizes[2] == sizes[6], f"bytes of each round's result that a rank that did not combine received, by world size: {sizes}"
    assert sum(s[0] for s in sizes[6]) < 600, sizes
    print(sizes)
