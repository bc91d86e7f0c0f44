"""The core's seams as the adapters use them through `tiercel._core`: shard info on items,
byte-range reads of one item, and errors that carry their fields."""

from __future__ import annotations

import json

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
