"""bench/bytes.py (issue 31 item 5, what storing unchanged chunks once saves): its --quick mode
runs end to end, with real training steps, Stores, an fs tier and moto, and its numbers are
sane: a LoRA state with dedup writes a small part of what it writes without, a MoE state
whose quarter of experts changes writes clearly less, a dense state the same, and every
restore (newest step and step 1, from the durable tier alone) was bit-identical."""

from __future__ import annotations

import json
import subprocess

import numpy as np
import pytest

from tiercel import _core

from conftest import PYTHON, TESTS_DIR, child_env

BENCH = TESTS_DIR.parent / "bench" / "bytes.py"


def test_quick_mode_runs_and_dedup_writes_what_changed(tmp_path):
    out = tmp_path / "bytes"
    p = subprocess.run([PYTHON, str(BENCH), "--quick", "--out", str(out), "--dir", str(tmp_path)], capture_output=True,
                       text=True, timeout=300, env=child_env(), cwd=str(TESTS_DIR.parent))
    assert p.returncode == 0, f"bench/bytes.py --quick exited {p.returncode}\n{p.stdout[-5000:]}\n{p.stderr[-5000:]}"
    res = json.loads((out.parent / "bytes.json").read_text())
    configs = {(c["workload"], c["tier"], c["dedup"]): c for c in res["configs"]}
    assert set(configs) == {(w, t, d) for w in ("lora", "moe", "dense") for t in ("fs", "s3") for d in (False, True)}

    def per_step(w: str, t: str, dedup: bool) -> float:
        later = configs[(w, t, dedup)]["steps"][1:]
        return sum(r["bytes_written"] for r in later) / len(later)

    for c in res["configs"]:
        assert c["restore"]["newest"]["identical"] and c["restore"]["old"]["identical"], c["restore"]
        assert c["restore"]["old"]["step"] == 1 and c["restore"]["newest"]["step"] == res["steps"]
        # Without dedup a step writes at least its own bytes; the first step always does.
        assert c["steps"][0]["bytes_written"] >= c["steps"][0]["state_bytes"], c["steps"][0]
        assert all(r["objects_removed"] == 0 for r in c["steps"]), "keep is unlimited: nothing is removed"
        if not c["dedup"]:
            assert all(r["bytes_written"] >= r["state_bytes"] for r in c["steps"]), c["steps"]
    for t in ("fs", "s3"):
        assert per_step("lora", t, True) < 0.4 * per_step("lora", t, False), t
        assert per_step("moe", t, True) < 0.6 * per_step("moe", t, False), t
        # Dense: every chunk changes; dedup writes what it would without (metadata aside).
        assert per_step("dense", t, True) > 0.95 * per_step("dense", t, False), t
        s3 = configs[("lora", "s3", True)]["steps"]
        assert all(sum(r["requests"].values()) > 0 for r in s3), "the s3 tier's requests were counted"
    assert all(lim["hash_gb_s"] > 0 and lim["memcpy_gb_s"] > 0 for lim in res["limits"].values())
    md = (out.parent / "bytes.md").read_text()
    assert "| lora | moto |" in md and "| goal | measured | met |" in md


def test_the_hash_binding_is_the_saves():
    """bench/bytes.py times `_core.crc32c_and_hash`: the core's own per-chunk CRC32C and XXH3-128."""
    # The reference implementation's XXH3-128 of the empty input; CRC-32/ISCSI's check value.
    assert _core.crc32c_and_hash(b"") == (0, "99aa06d3014798d86001c324468d497f")
    assert _core.crc32c_and_hash(b"123456789")[0] == 0xE3069283
    a = np.arange(1 << 20, dtype=np.uint32)
    assert _core.crc32c_and_hash(a.view(np.uint8)) == _core.crc32c_and_hash(a.tobytes())
    with pytest.raises(Exception, match="contiguous"):
        _core.crc32c_and_hash(a.view(np.uint8)[::2])
