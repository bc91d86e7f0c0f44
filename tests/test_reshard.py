"""The plain Store's resharding restore (`restore(..., reshard=...)`, tiercel.reshard): arrays
saved as pieces of global arrays (`tiercel.Sharded`) come back as whatever boxes the ranks
of a job at another world size ask for, bit-identical, read from RAM and peers.

The multi-process case: 4 ranks on 4 "hosts" (separate processes, each its own $TIERCEL_HOST
and memory root, a peer tier with replicas = 2 on loopback, an fs tier that gets every step)
save a sharded state; host D is lost (its root wiped); the job restarts on 3 hosts (A, B, C)
and then on 2 (A, C), and each rank reads the rows (and columns) it now owns, no byte from
the fs tier. With 4 hosts and replicas = 2 the placement is two groups, {A, B} and {C, D}:
saved rank 3 is left only in C's replica store, saved rank 1 in B's RAM and A's replica
store, so A and C between them still hold every saved rank's part."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import tiercel

from test_multirank import run_ranks

HOSTS = ["hostA", "hostB", "hostC", "hostD"]
STEP = 5


def global_state() -> dict[str, Any]:
    """The job's global arrays (the same in every process)."""
    rng = np.random.default_rng(2026)
    return {
        "w": rng.standard_normal((64, 1000)).astype(np.float32),  # rows sharded
        "h": torch.from_numpy(rng.standard_normal((48, 40)).astype(np.float32)).to(torch.bfloat16),  # rows sharded
        "emb": rng.integers(0, 1 << 40, (24, 96)),  # columns sharded (int64)
        "bias": rng.standard_normal(300),  # the same on every rank, saved unsharded
    }


def span(n: int, rank: int, world: int) -> slice:
    """Rank `rank`'s part of `n` rows among `world` ranks (the parts differ in size)."""
    return slice(rank * n // world, (rank + 1) * n // world)


def rank_state(rank: int, world: int) -> dict[str, Any]:
    """What rank `rank` of `world` saves: its rows of w and h, its columns of emb."""
    g = global_state()
    rows_w, rows_h, cols = span(64, rank, world), span(48, rank, world), span(96, rank, world)
    return {
        "model": {
            "w": tiercel.Sharded(g["w"][rows_w], (64, 1000), (rows_w.start, 0)),
            "h": tiercel.Sharded(g["h"][rows_h].clone(), (48, 40), (rows_h.start, 0)),
            "bias": g["bias"],
        },
        "emb": tiercel.Sharded(np.ascontiguousarray(g["emb"][:, cols]), (24, 96), (0, cols.start)),
        "meta": {"step": STEP, "rank": rank},
    }


def same(a: Any, b: Any) -> bool:
    """Bit-identical: the same type, dtype, shape and bytes."""
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and bytes(
            a.view(torch.uint8).numpy()) == bytes(b.contiguous().view(torch.uint8).numpy())
    return (isinstance(b, np.ndarray) and a.dtype == b.dtype and a.shape == b.shape
            and a.tobytes() == np.ascontiguousarray(b).tobytes())


def policy(shm_root: Path, disk: Path) -> dict[str, Any]:
    """RAM per host, peer replicas on 2 hosts, and a durable fs tier that gets every step."""
    return {
        "tier": [
            {"name": "ram", "kind": "memory", "root": f"{shm_root}/{{host}}", "keep": 2},
            {"name": "peer", "kind": "peer", "listen": "127.0.0.1:0", "replicas": 2, "keep": 2},
            {"name": "disk", "kind": "fs", "url": str(disk), "every": 1},
        ],
        "store": {"chunk_size": "64KiB", "threads": 1, "io_threads": 2},
    }


SAVE = r"""
import json, os, sys
from datetime import timedelta
import torch.distributed as dist
import tiercel
from test_reshard import STEP, rank_state

policy = json.loads(sys.argv[1].replace("{host}", os.environ["TIERCEL_HOST"]))
dist.init_process_group("gloo", init_method="env://", timeout=timedelta(seconds=60))
rank, world = dist.get_rank(), dist.get_world_size()
store = tiercel.Store(policy)
states = store.save(STEP, rank_state(rank, world)).wait(60, commit=True)
with open(os.path.join(sys.argv[2], f"states-{rank}.json"), "w") as f:
    json.dump(states, f)
dist.barrier()
os.kill(os.getpid(), 9)  # the whole job dies: no close
"""

RESTORE = r"""
import json, os, sys
from datetime import timedelta
import numpy as np
import torch.distributed as dist
import tiercel
from test_reshard import global_state, same, span

policy = json.loads(sys.argv[1].replace("{host}", os.environ["TIERCEL_HOST"]))
form = sys.argv[3]
dist.init_process_group("gloo", init_method="env://", timeout=timedelta(seconds=60))
rank, world = dist.get_rank(), dist.get_world_size()
store = tiercel.Store(policy)
if form == "callable":  # each item's part by its global shape: rows, columns for emb
    def want(name, shape):
        dim = 1 if name == "emb" else 0
        return (slice(None),) * dim + (span(shape[dim], rank, world),)
    got = store.restore(reshard=want)
else:
    got = store.restore(reshard={"model/w": span(64, rank, world), "model/h": np.s_[span(48, rank, world)],
                                 "emb": (slice(None), span(96, rank, world))})
g = global_state()
checks = {
    "w": same(g["w"][span(64, rank, world)], got["model"]["w"]),
    "h": same(g["h"][span(48, rank, world)], got["model"]["h"]),
    "emb": same(g["emb"][:, span(96, rank, world)], got["emb"]),
    "bias": same(g["bias"], got["model"]["bias"]),
    "meta": got["meta"] == {"step": 5, "rank": 0},  # unsharded values: saved rank 0's
}
info = store.last_restore
report = {"step": info.step, "tiers": info.tiers, "checks": checks,
          "bytes_read": {t: m["bytes_read"] or 0 for t, m in store.metrics().items()}}
with open(os.path.join(sys.argv[2], f"{form}-{world}-{rank}.json"), "w") as f:
    json.dump(report, f)
dist.barrier()  # every rank has read: the peer servers may go
store.close()
dist.destroy_process_group()
"""


def test_4_ranks_reshard_to_3_and_2_from_ram_and_peers(tmp_path, shm_root):
    out = tmp_path / "out"
    out.mkdir()
    pol = json.dumps(policy(shm_root, tmp_path / "disk"))

    def env_of(hosts: list[str]):
        return lambda r: {"TIERCEL_HOST": hosts[r], "OMP_NUM_THREADS": "1"}

    run_ranks(SAVE, [pol, str(out)], tmp_path, world=4, env_of=env_of(HOSTS), tag="save", killed=True)
    every = {"ram": "committed", "peer": "committed", "disk": "committed"}
    assert all(json.loads((out / f"states-{r}.json").read_text()) == every for r in range(4))
    # The durable tier has the step: reading none of it is the restore's choice.
    assert (tmp_path / "disk" / f"step-{STEP:012d}" / "COMMIT").exists()
    shutil.rmtree(shm_root / "hostD")  # host D is lost: its RAM and the replicas it held for C
    measured = {}
    for hosts, form in ((HOSTS[:3], "callable"), ([HOSTS[0], HOSTS[2]], "dict")):
        world = len(hosts)
        run_ranks(RESTORE, [pol, str(out), form], tmp_path, world=world, env_of=env_of(hosts), tag=f"restore-{world}")
        reports = [json.loads((out / f"{form}-{world}-{r}.json").read_text()) for r in range(world)]
        measured[world] = [r["bytes_read"] for r in reports]
        for rank, r in enumerate(reports):
            assert r["step"] == STEP and all(r["checks"].values()), (world, rank, r)
            assert r["bytes_read"]["disk"] == 0, (world, rank, r)
            assert set(r["tiers"]) <= {"ram", "peer"}, (world, rank, r)
        # Every new rank needs pieces that only another host (or this host's replica store) holds.
        assert all(r["bytes_read"]["peer"] > 0 for r in reports), (world, reports)
    print("bytes read per tier, by world size and rank:", measured)


# -- one process: the boxes, the errors -------------------------------------------------------------


def _save_two_ranks(make_store, policy, g: dict[str, Any], rows: list[slice]) -> None:
    """Two ranks (two Stores without a coordinator, sharing the tiers) save rows `rows[r]`
    of w; the commit happens when both parts are in."""
    stores = [make_store(policy, rank=r, world_size=2) for r in range(2)]
    handles = [s.save(1, {"w": tiercel.Sharded(g["w"][rows[r]], g["w"].shape, (rows[r].start, 0)),
                          "n": np.int64(7 + r)}) for r, s in enumerate(stores)]
    for h in handles:
        h.wait(30)


def test_any_box_of_a_step_of_another_world_size(make_store, policy):
    g = global_state()
    _save_two_ranks(make_store, policy, g, [slice(0, 40), slice(40, 64)])
    store = make_store(policy)  # one rank now
    whole = store.restore(reshard=True)
    assert same(g["w"], whole["w"]) and whole["n"] == 7  # unsharded: saved rank 0's
    assert store.last_restore.step == 1
    got = store.restore(1, reshard={"w": (slice(30, 50), slice(100, 101))})  # across both pieces
    assert same(g["w"][30:50, 100:101], got["w"])
    got = store.restore(1, reshard=lambda name, shape: np.s_[shape[0] - 3:])
    assert same(g["w"][61:], got["w"])
    # A box that is one saved piece, whole: no copy (from RAM, a view of shared memory).
    got = store.restore(1, reshard={"w": np.s_[40:64]})
    assert same(g["w"][40:], got["w"]) and not got["w"].flags.owndata
    # An empty box is a box.
    assert store.restore(1, reshard={"w": np.s_[5:5]})["w"].shape == (0, 1000)
    # Without reshard: a plain restore still refuses the other world size.
    with pytest.raises(tiercel.WorldSizeError):
        store.restore()
    with pytest.raises(tiercel.WorldSizeError):
        store.restore(reshard=False)


def test_a_region_no_saved_rank_holds_is_named(make_store, policy):
    g = global_state()
    _save_two_ranks(make_store, policy, g, [slice(0, 16), slice(40, 64)])  # rows 16:40 never saved
    store = make_store(policy)
    assert same(g["w"][40:50], store.restore(1, reshard={"w": np.s_[40:50]})["w"])
    with pytest.raises(tiercel.NotFoundError) as e:
        store.restore(1, reshard={"w": np.s_[10:20]})
    msg = str(e.value)
    assert e.value.step == 1 and e.value.item == "w", msg
    assert "step 1 item 'w'" in msg and "[(16, 20), (0, 1000)]" in msg, msg  # what is missing
    assert "rank 0: [(0, 16), (0, 1000)]; rank 1: [(40, 64), (0, 1000)]" in msg, msg  # what there is
    with pytest.raises(tiercel.NotFoundError, match=r"\[\(16, 40\), \(0, 1000\)\]"):
        store.restore(1, reshard=True)


def test_wrong_wants_and_pieces_are_refused_naming_the_item(make_store, policy, tmp_path):
    g = global_state()
    store = make_store(policy)
    with pytest.raises(tiercel.InvalidArgumentError, match="'w'.*does not lie inside the global shape"):
        store.save(1, {"w": tiercel.Sharded(g["w"][:16], (64, 1000), (50, 0))})
    with pytest.raises(tiercel.InvalidArgumentError, match="'b': Sharded wraps a numpy array or a torch tensor"):
        store.save(1, {"b": tiercel.Sharded(b"bytes", (5,), (0,))})
    store.save(2, {"w": tiercel.Sharded(g["w"][:16], (64, 1000), (0, 0)), "n": 1}).wait(30)
    with pytest.raises(tiercel.InvalidArgumentError, match=r"names 'x'.*sharded items.*'w' \(64, 1000\)"):
        store.restore(2, reshard={"x": np.s_[0:1]})
    with pytest.raises(tiercel.InvalidArgumentError, match=r"item 'w' \(global shape \(64, 1000\)\): dimension 0: 0:65"):
        store.restore(2, reshard={"w": np.s_[0:65]})
    with pytest.raises(tiercel.InvalidArgumentError, match="dimension 1: 0:10:2 is not a box"):
        store.restore(2, reshard={"w": np.s_[0:1, 0:10:2]})
    with pytest.raises(tiercel.InvalidArgumentError, match="a slice of the first dimension"):
        store.restore(2, reshard={"w": 3})
    with pytest.raises(tiercel.InvalidArgumentError, match="reshard= takes True"):
        store.restore(2, reshard="w")
    with pytest.raises(tiercel.InvalidArgumentError, match="neither rank="):
        store.restore(2, rank=0, reshard=True)
