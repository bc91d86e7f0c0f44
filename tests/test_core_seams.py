"""The core's seams as the adapters use them through `tiercel._core`: shard info on items,
byte-range reads of one item, and errors that carry their fields."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

from tiercel import _core


def _save_raw(core: _core.Store, step: int, items: list[tuple[str, np.ndarray, dict | None]]) -> None:
    """Saves uint8 arrays as one put through the low-level writer; a shard (dict) or None per item."""
    w = core.begin(step)
    specs = [(name, "array", "uint8", [a.size], a.nbytes, "{}", None if sh is None else json.dumps(sh))
             for name, a, sh in items]
    _, places = w.add_part("m", json.dumps({"t": "none"}), specs)
    w.copy_items([(index, a.ctypes.data) for (index, _), (_, a, _) in zip(places, items)])
    h = w.commit()
    assert h.wait(30)
    assert all(s in ("committed", "not scheduled") for _, s in h.states()), h.states()


def test_shard_info_round_trips_and_is_checked(store):
    core = store._core
    a = (np.arange(100_000) % 251).astype(np.uint8)
    shard = {"global_shape": [300_000], "offsets": [100_000], "replica_id": 2}
    _save_raw(core, 2, [("w", a, shard), ("b", a[:10], None)])
    items = json.loads(core.reader(2).manifest_json())["items"]
    assert items[0]["shard"] == shard
    assert "shard" not in items[1]  # omitted, not null: older readers see what they always saw
    # 6-tuples (no shard element at all) still work.
    w = core.begin(3)
    w.add_part("m", "{}", [("x", "array", "uint8", [4], 4, "{}")])
    w.abort()
    for bad, why in [({"global_shape": [10], "offsets": [8]}, "exceeds the global size 10"),
                     ({"global_shape": [10, 2], "offsets": [0, 0]}, "must match"),
                     ({"offsets": [0]}, "shard must be JSON")]:
        w = core.begin(4)
        with pytest.raises(_core.InvalidArgumentError, match=why):
            w.add_part("m", "{}", [("x", "array", "uint8", [4], 4, "{}", json.dumps(bad))])
        w.abort()


@pytest.mark.parametrize("tiers", [None, ["disk"]])
def test_read_range(store, tiers):
    core = store._core
    chunk = core.chunk_size  # 64 KiB in the test policy
    a = (np.arange(5 * chunk + 123) * 7 % 251).astype(np.uint8)
    _save_raw(core, 2, [("w", a, None)])  # every=2: on ram and disk
    store.flush()
    r = core.reader(2, None, tiers)
    for start, length in [(0, a.size), (chunk, chunk), (chunk - 5, 10), (2 * chunk + 1, 3), (a.size - 1, 1), (7, 0)]:
        buf, tier = r.read_range(0, start, length)
        assert np.array_equal(np.frombuffer(buf, np.uint8) if length else np.empty(0, np.uint8), a[start:start + length])
        assert tier == ("ram" if tiers is None else "disk")
        if length:
            assert buf.kind == ("view" if tiers is None else "owned")
    with pytest.raises(_core.InvalidArgumentError, match="outside"):
        r.read_range(0, a.size - 1, 2)


def test_gc_plan_is_what_gc_removes(make_store, shm_root, disk_root):
    """One planner: the plan (`tiercel gc --dry-run`) lists exactly what gc then removes, with
    reasons; a step that has not committed (yet) shows which ranks wrote it."""
    from conftest import make_policy

    pol = make_policy(shm_root, disk_root, every=1, ram={"keep": 1}, disk_opts={"keep": 1})
    store = make_store(pol)
    core = store._core
    for step in (1, 2, 3):
        store.save(step, {"w": np.full(1000, step, np.uint8)}).wait()
    store.flush()
    # Leftovers of a killed job: step 2 half-written on both tiers, and a temporary file
    # whose writer (no such process) is long gone.
    for root in (shm_root, disk_root):
        (root / _core.step_dir_name(2)).mkdir()
        (root / _core.step_dir_name(2) / "rank-00000.part-000.data").write_bytes(b"x")
    leftover = disk_root / _core.step_dir_name(3) / "rank-00000.data.tmp-999999999-0"
    leftover.write_bytes(b"abc")
    os.utime(leftover, (1, 1))
    for tier in ("ram", "disk"):
        plan = core.gc_plan(tier)
        assert [(r["step"], r["reason"]) for r in plan if r["what"] == "step"] == [(2, "uncommitted leftover")], plan
        assert core.gc(tier) == plan
        assert core.gc_plan(tier) == []
    assert [r for r in plan if r["what"] == "temp file"] == [
        {"what": "temp file", "step": None, "path": f"{_core.step_dir_name(3)}/{leftover.name}", "bytes": 3,
         "reason": "stale temporary file: its writer (pid 999999999) is gone"}]
    assert not leftover.exists()
    assert store.steps() == {"ram": [3], "disk": [3]}
    # Rank 1 of 2 writes step 4; rank 0 never does: the step shows rank 1 only.
    other = _core.Store(1, 2, policy_json=json.dumps(pol))
    w = other.begin(4)
    w.add_part("m", "{}", [("x", "array", "uint8", [4], 4, "{}")])
    w.copy_items([(0, np.zeros(4, np.uint8).ctypes.data)])
    w.commit()
    other.close()  # waits for the background jobs (not `wait()`: rank 0 never joins the memory commit)
    assert core.step_ranks("ram", 4) == [1] and core.step_ranks("disk", 4) == [1]
    assert json.loads(core.manifest_json("disk", 4, 1))["world_size"] == 2
    with pytest.raises(_core.NotFoundError):
        core.manifest_json("disk", 4, 0)


def test_every_kind_raises_its_class_with_its_fields(make_store, policy, shm_root, disk_root, tmp_path):
    import pickle

    import tiercel
    from tiercel import errors

    store = make_store()
    core = store._core
    # Config: the policy file and line.
    bad = tmp_path / "bad.toml"
    bad.write_text('[[tier]]\nname = "ram"\nkind = "memory"\nroot = "/dev/shm/x"\nkeep = -1\n')
    with pytest.raises(tiercel.ConfigError) as ei:
        tiercel.Store(str(bad), rank=0, world_size=1)
    assert ei.value.path == str(bad) and ":5:" in str(ei.value)
    # NotFound: the step and rank asked for.
    with pytest.raises(tiercel.NotFoundError) as ei:
        core.reader(99, None, None)
    assert (ei.value.step, ei.value.rank, ei.value.tier) == (99, 0, None)
    # InvalidArgument: the step and item.
    w = core.begin(1)
    with pytest.raises(tiercel.InvalidArgumentError) as ei:
        w.add_part("m", "{}", [("x", "array", "uint8", [4], 4, "{}", json.dumps({"global_shape": [2], "offsets": [0]}))])
    assert (ei.value.step, ei.value.item) == (1, "x")
    w.abort()
    # Integrity: tier, step, rank, item and chunk of the bad chunk.
    a = (np.arange(3 * core.chunk_size) % 251).astype(np.uint8)
    store.save(2, {"w": a}).wait()
    store.flush()
    m = json.loads(core.reader(2, None, ["ram"]).manifest_json())
    c1 = m["items"][0]["chunks"][1]
    part = shm_root / _core.step_dir_name(2) / m["objects"][c1["object"]]["name"]
    with open(part, "r+b") as f:
        f.seek(c1["stored_offset"] + 5)
        b = f.read(1)
        f.seek(c1["stored_offset"] + 5)
        f.write(bytes([b[0] ^ 1]))
    with pytest.raises(tiercel.IntegrityError) as ei:
        core.reader(2, None, ["ram"]).read_items([0])
    e = ei.value
    assert (e.step, e.rank, e.item, e.chunk) == (2, 0, "w", 1), repr(e)
    # Capacity: the tier, step and rank that did not fit.
    small = make_store({**policy, "tier": [{**policy["tier"][0], "root": str(shm_root) + "-small", "capacity": "64KiB"}],
                        "restore": {"order": ["ram"]}})
    try:
        with pytest.raises(tiercel.CapacityError) as ei:
            small.save(1, {"w": np.zeros(1 << 20, np.uint8)})
        assert (ei.value.tier, ei.value.step, ei.value.rank) == ("ram", 1, 0)
    finally:
        import shutil

        shutil.rmtree(str(shm_root) + "-small", ignore_errors=True)
    # TierUnavailable, from a background persist: SaveHandle.wait raises the tier's own error.
    import shutil

    shutil.rmtree(disk_root)
    disk_root.write_text("in the way")
    h = store.save(4, {"w": a})
    with pytest.raises(tiercel.TierUnavailableError) as ei:
        h.wait(60)
    assert (ei.value.tier, ei.value.step, ei.value.rank) == ("disk", 4, 0), repr(ei.value)
    assert [(t, type(x)) for t, x in h._core.errors()] == [("disk", tiercel.TierUnavailableError)]
    # The classes: one hierarchy, the same objects everywhere, picklable with their fields.
    for cls in (tiercel.ConfigError, tiercel.IntegrityError, tiercel.NotFoundError, tiercel.TierUnavailableError,
                tiercel.CapacityError, tiercel.InvalidArgumentError):
        assert issubclass(cls, tiercel.TiercelError) and cls.__module__ == "tiercel"
        assert getattr(_core, cls.__name__) is cls is getattr(errors, cls.__name__)
        e = cls("boom", tier="disk", step=3, rank=1, item="w", chunk=2, path="/x")
        back = pickle.loads(pickle.dumps(e))
        assert type(back) is cls and str(back) == "boom"
        assert [getattr(back, f) for f in errors.FIELDS] == ["disk", 3, 1, "w", 2, "/x"]
    assert tiercel.NotFoundError("m", step=3).rank is None
