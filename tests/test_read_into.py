"""Reads into the caller's memory (Reader.read_into) and the restore path's one parallel
pass that maps and verifies every chunk of every item: bit-identical bytes, a bad chunk
read from the next tier, clear errors for memory that cannot be written in place."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import tiercel

from conftest import chunk_location, flip_byte, random_numpy, random_torch


def saved(store: tiercel.Store, step: int = 2) -> dict:
    """A put of several multi-chunk items (64KiB chunks), committed on ram and disk."""
    model = {
        "w": random_numpy(np.float32, (300, 257), seed=1),
        "h": random_torch(torch.bfloat16, (129, 1000), seed=2),
        "b": random_numpy(np.float64, (7,), seed=3),
        "z": np.zeros((0, 4), dtype=np.float32),
    }
    assert store.save(step, {"model": model}).wait(60) == {"ram": "committed", "disk": "committed"}
    return model


def as_bytes(x) -> np.ndarray:
    """The bytes of an array or tensor (random bits hold NaNs: compare bytes)."""
    a = x.view(torch.uint8).numpy() if isinstance(x, torch.Tensor) else x.view(np.uint8)
    return a.reshape(-1)


@pytest.mark.parametrize("tiers", [None, ["disk"]])
def test_read_into_arrays_tensors_and_ranges(store, tiers):
    model = saved(store)
    r = store.reader(2, tiers=tiers)
    out = np.empty_like(model["w"])
    r.read_into("model/w", out)
    assert np.array_equal(as_bytes(out), as_bytes(model["w"]))
    t = torch.empty_like(model["h"])
    r.read_into("model/h", t)
    assert np.array_equal(as_bytes(t), as_bytes(model["h"]))
    r.read_into("model/z", np.empty((0, 4), dtype=np.float32))
    # Ranges that start and end inside chunks, and span several (64KiB chunks).
    want = as_bytes(model["w"])
    for start, n in ((0, 1), (65_535, 2), (1000, 200_000), (len(want) - 3, 3)):
        got = np.full(n, 0xAA, dtype=np.uint8)
        r.read_into("model/w", got, start=start)
        assert np.array_equal(got, want[start:start + n]), (start, n)
    # Any dtype fills with the bytes, as read() returns them.
    f = torch.empty(5000, dtype=torch.float16)
    r.read_into("model/h", f, start=2)
    assert np.array_equal(as_bytes(f), r.read("model/h", 2, 10_000))
    assert set(r.info.tiers) == {tiers[0] if tiers else "ram"}


def test_read_into_falls_back_to_the_next_tier_for_a_bad_chunk(store, shm_root):
    model = saved(store)
    path, off, _ = chunk_location(shm_root, 2, "model/w", chunk=2)
    flip_byte(path, off + 17)
    r = store.reader(2)
    out = np.empty_like(model["w"])
    r.read_into("model/w", out)
    assert np.array_equal(as_bytes(out), as_bytes(model["w"]))
    assert r.info.tiers == {"ram+disk": 1}
    assert any("chunk 2" in w and "disk" in w for w in r.info.warnings), r.info.warnings
    # With no other copy, the error names the item and chunk; nothing pretends to be data.
    with pytest.raises(tiercel.IntegrityError, match=r"model/w.*chunk 2"):
        store.reader(2, tiers=["ram"]).read_into("model/w", out)


def test_restore_verifies_all_items_in_one_pass_and_reads_only_a_bad_one_elsewhere(store, shm_root):
    model = saved(store)
    path, off, _ = chunk_location(shm_root, 2, "model/h", chunk=1)
    flip_byte(path, off)
    got = store.restore(2)["model"]
    for k, v in model.items():
        assert np.array_equal(as_bytes(got[k]), as_bytes(v)), k
    # The three good items are zero-copy views of RAM; the damaged one came partly from disk.
    assert store.last_restore.tiers == {"ram": 3, "ram+disk": 1}, store.last_restore


def test_read_into_refuses_memory_it_cannot_write_in_place(store):
    saved(store)
    r = store.reader(2)
    cases = [
        (np.empty(100)[::2], "C-contiguous"),
        (b"x" * 100, "read-only: True"),
        (torch.empty(10, 10).t(), "contiguous CPU tensor"),
        (np.empty(10**6), "outside its"),
        (3, "array, tensor or buffer"),
    ]
    for out, why in cases:
        with pytest.raises(tiercel.InvalidArgumentError, match=why):
            r.read_into("model/w", out)
    with pytest.raises(tiercel.NotFoundError):
        r.read_into("model/nope", np.empty(1))
