"""Metadata bit-flip sweep: one bit at a time over the memory tier's manifest of a committed
step (its intact copy on the fs tier), each followed by a restore. Every restore must give
the saved state bit for bit (from the intact copy) or raise a tiercel error: never another
state, never a raw KeyError/TypeError. This is the sweep that found 129 silently wrong
restores of 1,461 (issue 14.2), before manifests and commit records carried checksums.
TIERCEL_SWEEP_FLIPS sets how many bits are tried."""

from __future__ import annotations

import os
import random

import numpy as np

import tiercel

from conftest import assert_same, make_policy, manifest_path

FLIPS = int(os.environ.get("TIERCEL_SWEEP_FLIPS", "300"))


def want() -> dict:
    rng = np.random.default_rng(5)
    return {"w": rng.standard_normal(20_000).astype(np.float32), "b": rng.standard_normal(20_000).astype(np.float32),
            "meta": {"step": 7, "names": ["a", "b"]}}


def sweep(shm_root, disk_root) -> tuple[dict[str, int], list[str]]:
    policy = make_policy(shm_root, disk_root, every=1, chunk_size="64KiB", compression="none")
    with tiercel.Store(policy, rank=0, world_size=1) as store:
        store.save(7, want()).wait(60)
    path = manifest_path(shm_root, 7)
    original = path.read_bytes()
    bits = random.Random(14).sample(range(len(original) * 8), min(FLIPS, len(original) * 8))
    outcome: dict[str, int] = {"right": 0, "tiercel error": 0}
    wrong: list[str] = []
    for bit in bits:
        data = bytearray(original)
        data[bit // 8] ^= 1 << (bit % 8)
        path.write_bytes(bytes(data))
        try:
            with tiercel.Store(policy, rank=0, world_size=1) as store:
                got = store.restore(7)
            assert_same(got, want())
            outcome["right"] += 1
        except tiercel.TiercelError:
            outcome["tiercel error"] += 1
        except Exception as e:  # noqa: BLE001 -- counting exactly these is the point
            wrong.append(f"bit {bit}: {type(e).__name__}: {str(e)[:120]}")
    path.write_bytes(original)
    return outcome, wrong


def test_no_bit_flip_in_a_manifest_gives_a_wrong_restore(shm_root, disk_root):
    outcome, wrong = sweep(shm_root, disk_root)
    print(f"\nSWEEP {len(wrong)} wrong or raw errors, {outcome}")
    assert not wrong, f"{len(wrong)} of {len(wrong) + sum(outcome.values())} flips: " + "; ".join(wrong[:5])
