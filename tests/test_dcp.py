"""tiercel as torch.distributed.checkpoint's storage: a real FSDP2 job (fully_shard, gloo on
127.0.0.1, CPU, 2 ranks; tests/dcp_worker.py) saves through tiercel.dcp.Writer and is killed;
it resumes on 2 ranks, on 1 rank (DCP's planner reshards), and after one host's RAM is wiped
(peer tier), with the same values and, on 2 ranks, the same loss curve bit for bit as the run
that was not interrupted. `dcp.async_save` races the next training step; a rank killed in the
middle of a save leaves the previous step. Export gives a directory stock DCP loads."""

from __future__ import annotations

import json
import shutil
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

import tiercel
import tiercel.dcp
import tiercel.exports
from tiercel.dcp.reader import metadata_bytes, unpickle_metadata

from conftest import (
    assert_same,
    chunk_location,
    error_of,
    flip_byte,
    make_policy,
    manifest_path,
    raw_bytes,
    read_manifest,
    step_dir,
)
from dcp_worker import build_model
from test_multirank import run_ranks

SCRIPT = "import dcp_worker; dcp_worker.main()"


def run_job(tmp_path: Path, cfg: dict[str, Any], world: int = 2, hosts: list[str] | None = None,
            killed: bool = False) -> list[dict[str, Any]]:
    """Runs the worker on `world` ranks (rank r on host hosts[r]); returns their reports."""
    def env_of(rank: int) -> dict[str, str]:
        return {"OMP_NUM_THREADS": "1", **({"TIERCEL_HOST": hosts[rank]} if hosts else {})}

    out = Path(cfg["out"])
    out.mkdir(exist_ok=True)
    run_ranks(SCRIPT, [json.dumps(cfg)], tmp_path, world, env_of, tag=cfg["mode"], killed=killed)
    return [json.loads((out / f"{cfg['mode']}-{r}.json").read_text()) for r in range(world)]


def load(path: Path) -> Any:
    return torch.load(path, weights_only=False)


def copies_per_item(store: tiercel.Store, step: int) -> dict[str, int]:
    """How many copies of each DCP item the step keeps, by FQN (from rank 0's metadata)."""
    metadata = unpickle_metadata(metadata_bytes(store.reader(step, rank=0)), step)
    return {index.fqn: len(copies) for index, copies in metadata.storage_data.items()}


def key_sorted(tree: Any) -> Any:
    if isinstance(tree, dict):
        return {k: key_sorted(tree[k]) for k in sorted(tree, key=str)}
    if isinstance(tree, (list, tuple)):
        return type(tree)(key_sorted(v) for v in tree)
    return tree


def check_resumed(out: Path, trained: list[dict], resumed: list[dict], step: int) -> None:
    """Every rank got back exactly what it saved at `step`, and training on from there
    repeats the uninterrupted run's losses bit for bit."""
    for rank, (t, r) in enumerate(zip(trained, resumed)):
        assert r["step"] == step, r
        assert_same(load(out / f"loaded-{step}-{rank}.pt"), load(out / f"local-{step}-{rank}.pt"))
        later = sorted(r["losses"], key=int)
        assert later, r
        assert {s: r["losses"][s] for s in later} == {s: t["losses"][s] for s in later}, (rank, r["losses"], t["losses"])


@pytest.fixture
def out(tmp_path: Path) -> Path:
    return tmp_path / "out"


def test_fsdp2_save_kill_resume_reshard_export(tmp_path, out, shm_root, disk_root, make_store):
    policy = make_policy(shm_root, disk_root, every=2, ram={"keep": 2})
    base = {"policy": policy, "out": str(out), "saved_world": 2}
    trained = run_job(tmp_path, {**base, "mode": "train", "last": 6, "save": [2, 3, 4], "kill": True}, killed=True)
    for t in trained:
        assert {t["states"][s]["ram"] for s in "234"} <= {"committed", "written"}, t
        assert {t["states"][s]["disk"] for s in "24"} <= {"committed", "written"}, t
        assert t["states"]["3"]["disk"] == "not scheduled", t
    assert make_store(policy).steps() == {"ram": [3, 4], "disk": [2, 4]}
    # One host: DCP's planner writes each item once, replicated ones (the optimizer's step
    # counters and param groups) included.
    assert set(copies_per_item(make_store(policy), 4).values()) == {1}

    # (a) The same 2 ranks, from RAM: the newest step, the same values, the same losses after.
    resumed = run_job(tmp_path, {**base, "mode": "resume", "last": 6})
    check_resumed(out, trained, resumed, 4)
    assert all(set(r["tiers"]) == {"ram"} for r in resumed), resumed
    # Bit rot in rank 1's only copy of step 3 (ram; disk has every other step): every rank
    # gets DCP's exception, which carries tiercel's error from rank 1 naming the item.
    item = next(it["name"] for it in read_manifest(shm_root, 3, 1)["items"] if it["kind"] == "array")
    path, offset, _ = chunk_location(shm_root, 3, item, rank=1)
    flip_byte(path, offset)
    failed = run_job(tmp_path, {**base, "mode": "resume", "last": 6, "step": 3, "expect_error": True})
    assert all("IntegrityError" in r["error"] and item in r["error"] for r in failed), failed

    # (b) One rank reads both ranks' shards: DCP's planner reshards; every value the same.
    # It saves them again as step 10, whole tensors; two ranks then read half of each.
    (one,) = run_job(tmp_path, {**base, "mode": "resume", "last": 4, "resave": 10}, world=1)
    assert one["step"] == 4 and set(one["tiers"]) == {"ram"}, one
    assert_same(load(out / "loaded-full-4-w1.pt"), load(out / "full-4.pt"))
    run_job(tmp_path, {**base, "mode": "resume", "last": 10, "step": 10})
    for rank in range(2):
        assert_same(load(out / f"loaded-10-{rank}.pt"), load(out / f"local-4-{rank}.pt"))

    # An older step on request, from disk only (ram keeps the newest two).
    (older,) = run_job(tmp_path, {**base, "mode": "resume", "last": 2, "step": 2}, world=1)
    assert older["step"] == 2 and set(older["tiers"]) == {"disk"}, older
    assert_same(load(out / "loaded-full-2-w1.pt"), load(out / "full-2.pt"))

    # Export: stock DCP loads the directory without tiercel, and converts it to torch.save.
    exported = tiercel.dcp.export(policy, 4, tmp_path / "exported")
    full = load(out / "full-4.pt")
    model = build_model()
    target = {"model": model.state_dict()}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "assuming the intent is to load in a single process"
        dcp.load(target, storage_reader=dcp.FileSystemReader(exported))
    assert_same(dict(target["model"]), full["model"])
    dcp_to_torch_save(exported, tmp_path / "full.pt")
    assert_same(key_sorted(load(tmp_path / "full.pt")), key_sorted(full))  # DCP orders keys its own way
    assert error_of(lambda: tiercel.dcp.export(policy, 4, exported), tiercel.InvalidArgumentError).startswith(str(exported))

    # safetensors through the registry: every tensor whole (both ranks' shards put together),
    # under DCP's own names, bit for bit the full state; the optimizer's plain values skipped.
    from safetensors.torch import load_file

    st_dir = tiercel.exports.export(policy, 4, tmp_path / "st", format="safetensors", max_shard_size="4KB")
    index = json.loads((st_dir / "model.safetensors.index.json").read_text())
    tensors: dict[str, torch.Tensor] = {}
    for f in sorted(set(index["weight_map"].values())):
        tensors.update(load_file(st_dir / f))
    want = dict(flat_tensors(full))
    assert sorted(tensors) == sorted(want) and len(want) > 4, (sorted(tensors), sorted(want))
    for name, t in want.items():
        assert tensors[name].dtype == t.dtype and tensors[name].shape == t.shape, name
        assert raw_bytes(tensors[name]) == raw_bytes(t), name
    assert "optim.param_groups.0.lr" in json.loads((st_dir / "skipped.json").read_text())


def flat_tensors(tree: Any, prefix: str = "") -> Any:
    """(name, tensor) of every tensor in a nested state, keys joined with "." as DCP names them."""
    if isinstance(tree, torch.Tensor):
        yield prefix, tree
    elif isinstance(tree, dict):
        for k, v in tree.items():
            yield from flat_tensors(v, f"{prefix}.{k}" if prefix else str(k))
    elif isinstance(tree, (list, tuple)):
        for i, v in enumerate(tree):
            yield from flat_tensors(v, f"{prefix}.{i}" if prefix else str(i))


def test_async_save_races_training_and_a_kill_mid_save_leaves_the_previous_step(tmp_path, out, shm_root, disk_root,
                                                                                  make_store):
    policy = make_policy(shm_root, disk_root, every=100, ram={"keep": 3})
    base = {"policy": policy, "out": str(out), "saved_world": 2, "shm": str(shm_root)}
    run_job(tmp_path, {**base, "mode": "train", "async": True, "last": 9, "save": [2, 3, 4], "die_at": 4}, killed=True)
    trained = [json.loads((out / f"train-{r}.json").read_text()) for r in range(2)]
    # Rank 0 died inside step 4's write, after rank 1 had its part in: no COMMIT, no metadata.
    assert manifest_path(shm_root, 4, 1).exists() and not manifest_path(shm_root, 4, 0).exists()
    assert not (step_dir(shm_root, 4) / "COMMIT").exists()
    for t in trained:
        assert {t["states"][s]["ram"] for s in ("2", "3")} <= {"committed", "written"}, t

    resumed = run_job(tmp_path, {**base, "mode": "resume", "last": 5})
    check_resumed(out, trained, resumed, 3)  # step 4's training ran, its loss is in both curves

    # The staged copy is the only one: every tensor was written from where async_save staged it.
    # (DCP's byte items, the optimizer's param groups, are spread over the ranks by its planner.)
    store = make_store(policy)
    manifests = [store.reader(3, rank=rank).manifest for rank in range(2)]
    assert all({it.kind for it in m.items_of("dcp-staged")} == {"array"} for m in manifests)
    assert {it.kind for m in manifests for it in m.items_of("dcp")} == {"bytes"}, [m.items_of("dcp") for m in manifests]


def test_peer_tier_restores_a_wiped_host(tmp_path, out, shm_root, make_store):
    hosts = ["hostA", "hostB"]
    policy = {
        "tier": [
            {"name": "ram", "kind": "memory", "root": f"{shm_root}/{{host}}", "keep": 2},
            {"name": "peer", "kind": "peer", "listen": "127.0.0.1:0", "replicas": 2, "keep": 2},
        ],
        "store": {"chunk_size": "64KiB", "threads": 1, "io_threads": 2},
    }
    base = {"policy": policy, "out": str(out), "saved_world": 2}
    trained = run_job(tmp_path, {**base, "mode": "train", "last": 5, "save": [3], "kill": True}, hosts=hosts, killed=True)
    assert all(t["states"]["3"] == {"ram": "committed", "peer": "committed"} for t in trained), trained
    # Two hosts: each keeps its own copy of what both ranks hold (the optimizer's step counters
    # and param groups); each rank's shards once.
    copies = copies_per_item(make_store({"tier": [{"name": "ram", "kind": "memory", "root": f"{shm_root}/hostA"}]}), 3)
    assert {n for fqn, n in copies.items() if ".step" in fqn or "param_groups" in fqn} == {2}, copies
    assert {n for fqn, n in copies.items() if fqn.startswith("model.") or ".exp_avg" in fqn} == {1}, copies
    shutil.rmtree(shm_root / "hostB")  # a replacement machine: its own steps and the replicas it held
    resumed = run_job(tmp_path, {**base, "mode": "resume", "last": 5}, hosts=hosts)
    check_resumed(out, trained, resumed, 3)
    # Rank 1 read its shards from host A's RAM over the peer tier; DCP's metadata, which only
    # rank 0's step holds, came from rank 0 (host B cannot read host A's RAM).
    assert [set(r["tiers"]) for r in resumed] == [{"ram"}, {"peer"}], resumed


# -- one process: no torch.distributed ---------------------------------------------------------


def _state(seed: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    return {"model": {"w": torch.randn(40, 30, generator=g), "b": torch.arange(7)},
            "meta": {"lr": 0.5, "name": "x"}, "count": torch.tensor(seed)}


def _zeros_like(state: dict[str, Any]) -> dict[str, Any]:
    return {"model": {k: torch.zeros_like(v) for k, v in state["model"].items()},
            "meta": {"lr": 0.0, "name": ""}, "count": torch.tensor(0)}


@pytest.fixture
def single(policy):
    warnings.filterwarnings("ignore", message="torch.distributed is disabled")
    yield policy
    tiercel.dcp.close()


def test_single_process_save_load_by_checkpoint_id_and_the_store_is_opened_once(single):
    w = tiercel.dcp.Writer(single)
    dcp.save(_state(1), storage_writer=w, checkpoint_id=1)
    assert tiercel.dcp.Writer(single).store is w.store and tiercel.dcp.Reader(single).store is w.store
    w2 = tiercel.dcp.Writer(w.store, step=2)
    assert w2.store is w.store
    dcp.save(_state(2), storage_writer=w2)
    w2.handle.wait(30)
    for step in (1, 2):
        got = _zeros_like(_state(0))
        r = tiercel.dcp.Reader(single, step=step)
        dcp.load(got, storage_reader=r)
        assert_same(got, _state(step))
        assert r.step == step
    newest = _zeros_like(_state(0))
    dcp.load(newest, storage_reader=tiercel.dcp.Reader(single))
    assert_same(newest, _state(2))
    # A writer saves one step: saving again needs a step of its own. (DCP gathers the ranks'
    # errors into one CheckpointException, a BaseException; tiercel's message is in it.)
    assert "no step to save" in error_of(lambda: dcp.save(_state(3), storage_writer=w2), CheckpointException)


def test_clear_errors(single, store):
    store.save(5, {"model": {"w": np.zeros(3)}})
    store.flush()
    msg = error_of(lambda: dcp.load(_zeros_like(_state(0)), storage_reader=tiercel.dcp.Reader(single, step=5)), CheckpointException)
    assert "tiercel.dcp.Writer" in msg and "step 5" in msg
    msg = error_of(lambda: dcp.load(_zeros_like(_state(0)), storage_reader=tiercel.dcp.Reader(single, step=9)), CheckpointException)
    assert "step 9" in msg
    assert "checkpoint_id" in error_of(lambda: tiercel.dcp.Writer(single, step="x"), tiercel.InvalidArgumentError)
    assert "step=N" in error_of(lambda: dcp.async_save(_state(1), storage_writer=tiercel.dcp.Writer(single)),
                                tiercel.InvalidArgumentError)
    assert "not tiercel's" in error_of(lambda: tiercel.dcp._layout.Where.copies(object(), "x"), tiercel.IntegrityError)


def test_box_reads_only_the_chunks_that_hold_it(single, store, shm_root):
    t = torch.arange(64 * 1024 * 3, dtype=torch.float32).reshape(3 * 256, 256)  # 3 chunks of 64 KiB... x4 bytes
    store.save(1, {"dcp": {"t": t}})
    store.flush()
    reader = store.reader(1)
    (it,) = reader.items("dcp")
    # Rows 300..320 lie in one chunk; a box inside columns is a strided view of the same run.
    assert torch.equal(tiercel.dcp._layout.read_box(reader, it, (300, 0), (20, 256)), t[300:320])
    assert torch.equal(tiercel.dcp._layout.read_box(reader, it, (300, 10), (20, 5)), t[300:320, 10:15])
    assert torch.equal(tiercel.dcp._layout.read_box(reader, it, (0, 0), (0, 256)), t[:0])
    # A corrupt chunk the box does not touch is never read.
    path = step_dir(shm_root, 1) / reader.manifest.objects[it.chunks[-1].object][0]
    with open(path, "r+b") as f:
        f.seek(it.chunks[-1].stored_offset)
        f.write(b"\xff" * 8)
    fresh = store.reader(1)
    assert torch.equal(tiercel.dcp._layout.read_box(fresh, it, (0, 0), (64, 256)), t[:64])
    with pytest.raises(tiercel.IntegrityError):
        tiercel.dcp._layout.read_box(fresh, it, (700, 0), (10, 256))


# -- a load right after a save gets that save (issue 28 item 6) ----------------------------------


def test_load_of_the_newest_step_right_after_a_save_gets_that_step(single):
    """DCP's own suite saves and loads at once: the newest step is the one this process just
    saved, though its memory commit may still be in flight (never the one before)."""
    for k in range(1, 7):
        dcp.save(_state(k), storage_writer=tiercel.dcp.Writer(single, step=k))
        got = _zeros_like(_state(0))
        r = tiercel.dcp.Reader(single)
        dcp.load(got, storage_reader=r)
        assert r.step == k
        assert_same(got, _state(k))


@pytest.mark.parametrize("world", [1, 2])
def test_ranks_load_the_step_they_just_saved_as_saved_and_resharded(tmp_path, out, shm_root, disk_root, world):
    policy = make_policy(shm_root, disk_root, every=2, ram={"keep": 2})
    last = 6
    reports = run_job(tmp_path, {"policy": policy, "out": str(out), "mode": "saveload", "last": last}, world=world)
    for rank, report in enumerate(reports):
        # [saved step, loaded step, the sharded tensor's values, the plain one's, meta's k], as
        # saved and then resharded, after each save.
        want = [[k, k, [float(k)], [float(k)], float(k)] for k in range(1, last + 1) for _ in range(2)]
        assert report["loads"] == want, (rank, report["loads"])
