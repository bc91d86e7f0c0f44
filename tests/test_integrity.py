"""Damaged checkpoints: flipped bytes, lost or garbled manifests, truncated data, garbage
commit records; invalid input; failed saves; a tier that cannot be written. Every case ends
in correct data from another tier or in a clear tiercel error, never in garbage."""

from __future__ import annotations

import gc
import json
import os
import shutil

import numpy as np
import pytest
import torch

import tiercel

from conftest import (
    assert_same,
    chunk_location,
    error_of,
    files_under,
    flip_byte,
    manifest_path,
    read_manifest,
    step_dir,
)


def state(seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    return {
        "model": {
            "w": rng.standard_normal(50_000).astype(np.float32),  # 200 KB: chunks 0..3 of 64 KiB
            "b": torch.from_numpy(rng.standard_normal(100)),
        },
        "optim": {"m": rng.integers(0, 1000, 20_000), "step": seed},
    }


def saved(policy: dict, steps: dict[int, dict]) -> None:
    """Saves steps in a store that is closed and gone before the test touches the files, as a
    crashed trainer would leave them."""
    s = tiercel.Store(policy, rank=0, world_size=1)
    for step, st in steps.items():
        s.save(step, st).wait(60)
    s.close()
    del s
    gc.collect()


def ram(policy) -> str:
    return policy["tier"][0]["root"]


def disk(policy) -> str:
    return policy["tier"][1]["url"]


def names_all(msg: str, *parts: str) -> None:
    for p in parts:
        assert p in msg, f"{p!r} not in message: {msg}"


# -- flipped bytes ---------------------------------------------------------------------------


def test_flipped_byte_in_ram_falls_back_to_disk(policy, make_store):
    saved(policy, {2: state(2)})
    path, off, length = chunk_location(ram(policy), 2, "model/w", chunk=1)
    flip_byte(path, off + length // 2)

    store = make_store()
    got = store.restore()
    assert_same(got, state(2))
    info = store.last_restore
    assert info.step == 2
    # The damaged item came (at least its bad chunk) from disk; the others from ram.
    assert any("disk" in t for t in info.tiers), info.tiers
    assert "ram" in info.tiers, info.tiers
    warning = " ".join(info.warnings)
    names_all(warning, "model/w", "chunk 1", "'ram'", "'disk'")

    # With ram as the only tier asked, the damage is an error that says where it is.
    msg = error_of(lambda: store.reader(2, tiers=["ram"]).get("model"), tiercel.IntegrityError)
    names_all(msg, "tier 'ram'", "step 2", "rank 0", "'model/w'", "chunk 1", "checksum")
    # Items without damage still read from ram alone.
    assert_same(store.reader(2, tiers=["ram"]).get("optim"), state(2)["optim"])


def test_flipped_byte_on_disk_with_ram_gone(policy, make_store):
    saved(policy, {2: state(2)})
    shutil.rmtree(step_dir(ram(policy), 2))
    path, off, length = chunk_location(disk(policy), 2, "optim/m", chunk=0)
    flip_byte(path, off + length // 2)

    store = make_store()
    assert store.steps() == {"ram": [], "disk": [2]}
    msg = error_of(store.restore, tiercel.IntegrityError)
    names_all(msg, "tier 'disk'", "step 2", "rank 0", "'optim/m'")
    # The undamaged put is still readable.
    assert_same(store.reader(2).get("model"), state(2)["model"])


def test_flipped_byte_on_disk_ram_intact(policy, make_store):
    saved(policy, {2: state(2)})
    path, off, length = chunk_location(disk(policy), 2, "model/w", chunk=3)
    flip_byte(path, off + length - 1)
    store = make_store()
    assert_same(store.restore(), state(2))
    assert set(store.last_restore.tiers) == {"ram"}
    msg = error_of(lambda: store.reader(2, tiers=["disk"]).get_all(), tiercel.IntegrityError)
    names_all(msg, "tier 'disk'", "step 2", "rank 0", "'model/w'", "chunk 3")


def test_every_flipped_chunk_is_caught(policy, make_store):
    """A flip anywhere in any item's stored bytes is detected on the tier that has it."""
    saved(policy, {2: state(2)})
    store = make_store()
    m = read_manifest(ram(policy), 2)
    for item in m["items"]:
        for c, _ in enumerate(item["chunks"]):
            for root, tier in ((ram(policy), "ram"), (disk(policy), "disk")):
                path, off, length = chunk_location(root, 2, item["name"], chunk=c)
                flip_byte(path, off)
                put = item["name"].split("/")[0]
                with pytest.raises(tiercel.IntegrityError, match=f"'{item['name']}' chunk {c}"):
                    store.reader(2, tiers=[tier]).get(put)
                flip_byte(path, off)  # heal
    assert_same(store.reader(2, tiers=["ram"]).get_all(), state(2))
    assert_same(store.reader(2, tiers=["disk"]).get_all(), state(2))


# -- manifests, data files, commit records ---------------------------------------------------


def _garbage(p):
    p.write_bytes(b"{not a manifest")


def _missing(p):
    p.unlink()


def _truncated(p):
    p.write_bytes(p.read_bytes()[: p.stat().st_size // 2])


def _wrong_step(p):
    m = json.loads(p.read_text())
    m["step"] = 7
    p.write_text(json.dumps(m))


def _outside(p):
    m = json.loads(p.read_text())
    m["items"][0]["chunks"][-1]["stored_offset"] = 10**12
    p.write_text(json.dumps(m))


def _newer_version(p):
    m = json.loads(p.read_text())
    m["version"] = 999
    p.write_text(json.dumps(m))


MANIFEST_DAMAGE = [_garbage, _missing, _truncated, _wrong_step, _outside, _newer_version]


@pytest.mark.parametrize("damage", MANIFEST_DAMAGE, ids=lambda f: f.__name__.strip("_"))
def test_damaged_ram_manifest(policy, make_store, damage):
    saved(policy, {2: state(2)})
    damage(manifest_path(ram(policy), 2))
    store = make_store()
    # restore() reads everything from disk instead, and says why.
    assert_same(store.restore(), state(2))
    assert set(store.last_restore.tiers) == {"disk"}
    # Asked of ram alone: a clear error naming the tier or file, the step and rank.
    with pytest.raises(tiercel.TiercelError) as ei:
        store.reader(2, tiers=["ram"]).get_all()
    msg = str(ei.value)
    assert type(ei.value) in (tiercel.IntegrityError, tiercel.NotFoundError), type(ei.value)
    assert "step 2" in msg and "rank 0" in msg, msg
    assert "ram" in msg, msg


@pytest.mark.parametrize("damage", MANIFEST_DAMAGE, ids=lambda f: f.__name__.strip("_"))
def test_damaged_manifest_everywhere(policy, make_store, damage):
    saved(policy, {2: state(2), 4: state(4)})
    for root in (ram(policy), disk(policy)):
        damage(manifest_path(root, 4))
    store = make_store()
    # Explicitly asked for: an error, never garbage.
    with pytest.raises(tiercel.TiercelError) as ei:
        store.restore(4)
    names_all(str(ei.value), "step 4", "rank 0")
    # Asked for the newest: step 4 cannot be opened by this rank, so step 2 it is.
    assert_same(store.restore(), state(2))
    assert store.last_restore.step == 2
    assert any("step 4" in w for w in store.last_restore.warnings), store.last_restore.warnings


@pytest.mark.parametrize("tier", ["ram", "disk"])
@pytest.mark.parametrize("how", ["truncated", "missing", "empty"])
def test_damaged_data_file(policy, make_store, tier, how):
    saved(policy, {2: state(2)})
    root = ram(policy) if tier == "ram" else disk(policy)
    other = "disk" if tier == "ram" else "ram"
    path, _, _ = chunk_location(root, 2, "model/w")
    if how == "truncated":
        os.truncate(path, path.stat().st_size // 2)
    elif how == "missing":
        path.unlink()
    else:
        os.truncate(path, 0)
    store = make_store()
    # The other tier has a good copy.
    assert_same(store.restore(), state(2))
    assert any(other in t for t in store.last_restore.tiers), store.last_restore.tiers
    # This tier alone: a clear error.
    with pytest.raises(tiercel.IntegrityError) as ei:
        store.reader(2, tiers=[tier]).get_all()
    names_all(str(ei.value), f"tier '{tier}'", "step 2", "rank 0", "'model/")
    # Both copies damaged: an error, not garbage.
    shutil.rmtree(step_dir(ram(policy) if other == "ram" else disk(policy), 2))
    with pytest.raises(tiercel.TiercelError):
        store.reader(2).get_all()


@pytest.mark.parametrize("content", [b"garbage", b"", b'{"format": "tiercel-commit"}', b"\xff\xfe\x00"])
def test_garbage_commit_record(policy, make_store, content):
    saved(policy, {2: state(2)})
    commit = step_dir(ram(policy), 2) / "COMMIT"
    commit.write_bytes(content)
    store = make_store()
    # The ram copy cannot be trusted as committed: disk serves the restore.
    assert_same(store.restore(), state(2))
    assert set(store.last_restore.tiers) == {"disk"}
    with pytest.raises(tiercel.TiercelError) as ei:
        store.reader(2, tiers=["ram"])
    msg = str(ei.value)
    assert "commit record" in msg and str(commit) in msg, msg
    assert "step 2" in msg, msg

    # No good copy anywhere: restore() says so, naming the commit record.
    (step_dir(disk(policy), 2) / "COMMIT").write_bytes(content)
    with pytest.raises(tiercel.TiercelError) as ei:
        store.restore()
    assert "commit record" in str(ei.value), str(ei.value)


def test_garbage_in_tier_root_is_ignored(policy, make_store):
    saved(policy, {2: state(2)})
    for root in (ram(policy), disk(policy)):
        os.makedirs(os.path.join(root, "step-12"))
        os.makedirs(os.path.join(root, "step-abc"))
        os.makedirs(os.path.join(root, "step-000000000009"))  # a leftover without COMMIT
        with open(os.path.join(root, "README"), "w") as f:
            f.write("hello")
    store = make_store()
    assert store.steps() == {"ram": [2], "disk": [2]}
    assert_same(store.restore(), state(2))
    with pytest.raises(tiercel.NotFoundError):
        store.restore(9)


# -- invalid input -------------------------------------------------------------------------------


def test_meta_tensor_is_refused_by_name(store):
    msg = error_of(lambda: store.save(1, {"model": {"layer": {"w": torch.empty(3, 4, device="meta")}}}), tiercel.InvalidArgumentError)
    names_all(msg, "model/layer/w", "meta")


@pytest.mark.parametrize(
    "value, kind",
    [
        ([1, 2], "list"),
        (np.ones(3), "ndarray"),
        ("model", "str"),
        (None, "NoneType"),
        ({1: np.ones(3)}, "dict"),
    ],
)
def test_save_takes_a_dict_of_str(store, value, kind):
    msg = error_of(lambda: store.save(1, value), tiercel.InvalidArgumentError)
    assert kind in msg and "writer" in msg, msg
    assert store.steps() == {"ram": [], "disk": []}


@pytest.mark.parametrize("step", [-1, 1.0, "3", True, None])
def test_bad_step_numbers(store, step):
    with pytest.raises(tiercel.InvalidArgumentError, match="step"):
        store.save(step, {"a": np.ones(2)})


def test_unsupported_tensors(store):
    sparse = torch.eye(3).to_sparse()
    msg = error_of(lambda: store.save(1, {"m": {"s": sparse}}), tiercel.InvalidArgumentError)
    names_all(msg, "m/s", "to_dense")
    msg = error_of(lambda: store.save(1, {"m": {object(): 1}}), tiercel.InvalidArgumentError)
    assert "key" in msg, msg


def test_unknown_step_tier_and_rank(store):
    store.save(2, state(2)).wait(60)
    with pytest.raises(tiercel.NotFoundError, match="step 5"):
        store.restore(5)
    with pytest.raises(tiercel.TiercelError, match="tape"):
        store.reader(2, tiers=["tape"])
    with pytest.raises(tiercel.InvalidArgumentError, match="rank 3"):
        store.reader(2, rank=3)


def test_restore_with_nothing_saved(store):
    msg = error_of(store.restore, tiercel.NotFoundError)
    assert "no step" in msg, msg


# -- failed saves ----------------------------------------------------------------------------------


def _no_trace(policy, store, step):
    """No data, manifest or commit of `step` on any tier, and no tier lists it as committed."""
    store.flush()
    for root in (ram(policy), disk(policy)):
        if step_dir(root, step).exists():
            assert files_under(step_dir(root, step)) == [], files_under(step_dir(root, step))
    for tier, steps in store.steps().items():
        assert step not in steps, (tier, steps)
    with pytest.raises(tiercel.NotFoundError):
        store.reader(step)


@pytest.mark.parametrize("where", ["first put", "second put", "after puts"])
def test_exception_in_writer_leaves_no_trace(policy, store, where):
    store.save(2, state(2)).wait(60)
    store.flush()
    used = store._core.memory_used()
    # An unpicklable leaf is an InvalidArgumentError naming its path ("second put").
    with pytest.raises((RuntimeError, tiercel.InvalidArgumentError), match="boom"):
        with store.writer(4) as w:
            if where != "first put":
                w.put("model", state(4)["model"])
            if where == "second put":
                w.put("optim", {"m": np.ones(1000), "gen": _Boom()})
            raise RuntimeError("boom")
    _no_trace(policy, store, 4)
    assert store._core.memory_used() <= used
    assert_same(store.restore(), state(2))
    assert store.last_restore.step == 2
    # The step number is free to be used again, and that works.
    store.save(4, state(4)).wait(60)
    assert_same(store.restore(), state(4))


class _Boom:
    def __reduce__(self):
        raise RuntimeError("boom: cannot pickle")


def test_failed_save_leaves_no_trace(policy, store):
    store.save(2, state(2)).wait(60)
    with pytest.raises(tiercel.InvalidArgumentError, match="meta"):
        store.save(4, {"model": state(4)["model"], "optim": {"w": torch.empty(2, device="meta")}})
    with pytest.raises(tiercel.InvalidArgumentError, match="'extra'.*cannot pickle"):
        store.save(4, {"model": state(4)["model"], "extra": _Boom()})
    _no_trace(policy, store, 4)
    assert_same(store.restore(), state(2))


# -- a tier that cannot be written ---------------------------------------------------------------


def test_fs_tier_below_a_file_fails_to_open(policy, tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    policy["tier"][1]["url"] = str(blocker / "disk")
    msg = error_of(lambda: tiercel.Store(policy, rank=0, world_size=1), tiercel.TierUnavailableError)
    names_all(msg, "'disk'", str(blocker))


def test_persist_failure_reported_ram_still_committed(policy, make_store):
    store = make_store()
    store.save(2, state(2)).wait(60)
    # The fs tier's directory turns into a regular file under a running store (root ignores
    # permission bits, so chmod would prove nothing here).
    shutil.rmtree(disk(policy))
    with open(disk(policy), "w") as f:
        f.write("in the way")
    h = store.save(4, state(4))
    msg = error_of(lambda: h.wait(60), tiercel.TierUnavailableError)
    names_all(msg, "tier 'disk'", "step 4")
    states = h.states()
    assert states["ram"] == "committed", states
    assert states["disk"].startswith("failed"), states
    assert_same(store.restore(), state(4))
    assert set(store.last_restore.tiers) == {"ram"}
    # Odd steps do not touch disk: nothing to fail.
    assert store.save(5, state(5)).wait(60) == {"ram": "committed", "disk": "not scheduled"}


def test_aborted_step_leaves_no_directory(policy, store):
    store.save(2, state(2)).wait(60)
    with pytest.raises(RuntimeError):
        with store.writer(4) as w:
            w.put("model", state(4)["model"])
            raise RuntimeError("boom")
    store.flush()
    assert 4 not in store._core.all_steps("ram"), store._core.all_steps("ram")
    assert not step_dir(ram(policy), 4).exists()


def test_garbage_commit_record_is_an_integrity_error(policy, make_store):
    saved(policy, {2: state(2)})
    (step_dir(ram(policy), 2) / "COMMIT").write_bytes(b"garbage")
    store = make_store()
    with pytest.raises(tiercel.IntegrityError):
        store.reader(2, tiers=["ram"])
