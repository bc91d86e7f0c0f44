"""The adapter kit (tiercel.kit) on its own, in one process: the shared Stores, the step view
and its one-save rule, the step agreement, and _tree's reading API that adapters use.
(The adapters' own tests run it across ranks: test_deepspeed*.py, test_dcp.py, test_orbax*.py.)"""

from __future__ import annotations

import numpy as np
import pytest

import tiercel
from tiercel import _tree, kit
from tiercel.step_view import StepView, items_by_key

from conftest import make_policy, new_shm_root


def test_acquire_shares_one_store_per_policy_until_its_last_release(policy):
    a = kit.acquire(policy, job=(0, 1))
    b = kit.acquire(dict(policy), job=(0, 1))  # an equal dict is the same policy
    assert a is b and not a.closed
    other_job = kit.acquire(policy, job=(0, 1), tool=True)  # other options: its own Store
    assert other_job is not a
    assert kit.release(other_job) and other_job.closed
    assert not kit.release(a) and not a.closed  # b still holds it
    assert kit.release(b) and a.closed
    # Closed: the next acquire opens a new one.
    c = kit.acquire(policy, job=(0, 1))
    assert c is not a and not c.closed
    kit.close_all()
    assert c.closed


def test_a_store_passed_in_is_never_closed_by_the_kit(policy):
    with tiercel.Store(policy, rank=0, world_size=1) as store:
        assert kit.acquire(store) is store
        assert not kit.release(store) and not store.closed
        with kit.borrow(store) as borrowed:
            assert borrowed is store
        assert not store.closed
    assert store.closed


def test_the_view_reads_one_save_and_passes_over_a_tier_holding_another(tmp_path):
    """Step 5 saved (save A) into RAM and disk, then saved again (save B) by a process whose
    memory tier is elsewhere: RAM holds A, disk B. A view of the save B reads the disk; a
    view without a save reads the first tier's (A); a save no tier holds is NotFoundError."""
    roots = [new_shm_root("kit"), new_shm_root("kit")]
    try:
        first, second = (make_policy(r, tmp_path / "disk", every=1) for r in roots)
        old = {"w": np.arange(1000, dtype=np.float32)}
        new = {"w": -np.arange(1000, dtype=np.float32)}
        with tiercel.Store(first, rank=0, world_size=1) as store:
            store.save(5, old).wait(60)
            store.flush()
        with tiercel.Store(second, rank=0, world_size=1) as store:
            store.save(5, new).wait(60)
            saved_b = store.reader(5).save
        with tiercel.Store(first, rank=0, world_size=1) as store:
            saved_a = store.reader(5).save
            assert saved_a != saved_b and None not in (saved_a, saved_b)
            agreed = kit.agree(store, kit.Need())
            assert (agreed.step, agreed.save) == (5, saved_a)

            view = StepView(store, 5, save=saved_b)
            assert np.array_equal(view.reader(0).get("w"), new["w"])
            assert view.info().tiers == {"disk": 1}
            assert view.world_size == 1

            first_read = StepView(store, 5)
            assert np.array_equal(first_read.reader(0).get("w"), old["w"]) and first_read.save == saved_a
            assert first_read.info().tiers == {"ram": 1}

            with pytest.raises(tiercel.NotFoundError, match=r"step 5 rank 0: no tier .* holds the save"):
                StepView(store, 5, save="nobody-saved-this").reader(0)
    finally:
        import shutil

        for r in roots:
            shutil.rmtree(r, ignore_errors=True)


def test_agree_passes_over_steps_the_adapter_refuses(shm_root, disk_root):
    with tiercel.Store(make_policy(shm_root, disk_root, ram={"keep": 5}), rank=0, world_size=1) as store:
        for step in (1, 2, 3):
            store.save(step, {"x": np.full(4, step)}).wait(60)
        asked: list[int] = []

        def accept(step: int) -> str | None:
            asked.append(step)
            return None if step == 1 else "not this one"

        agreed = kit.agree(store, kit.Need(), accept=accept)
        assert agreed.step == 1 and asked == [3, 2, 1]
        assert [w.split(":")[0] for w in agreed.skipped] == ["step 3 passed over", "step 2 passed over"]
        assert kit.agree(store, kit.Need(), only=lambda s: s < 3).step == 2
        assert kit.agree(store, kit.Need(), below=1).step is None


def test_tree_reading_api_finds_items_by_key(policy):
    with tiercel.Store(policy, rank=0, world_size=1) as store:
        store.save(1, {"p": {"a": np.zeros(3), 7: np.ones(2), "n": 5}}).wait(60)
        reader = store.reader(1)
        tree = reader.manifest.trees["p"]
        entries = _tree.dict_entries(tree)
        assert entries is not None and [k for k, _ in entries] == ["a", 7, "n"]
        assert _tree.item_ref(_tree.entry(tree, "a")) == 0 and _tree.item_ref(_tree.entry(tree, 7)) == 1
        assert _tree.entry(tree, "7") is None and _tree.entry(tree, "missing") is None
        assert _tree.scalar_value(_tree.entry(tree, "n")) == 5 and _tree.item_ref(_tree.entry(tree, "n")) is None
        assert _tree.dict_entries({"t": "list", "v": []}) is None
        by_key = items_by_key(reader.manifest, "p")
        assert sorted(by_key) == ["7", "a"] and by_key["a"].shape == (3,)
        with pytest.raises(tiercel.NotFoundError, match="nothing was put under 'q'"):
            items_by_key(reader.manifest, "q")
