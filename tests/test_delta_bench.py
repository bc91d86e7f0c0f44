"""bench/delta.py (issue 31 item 4, the delta-encoding measurement): its XOR delta is exactly
invertible, and its smoke mode runs end to end through real Stores and fs tiers."""

from __future__ import annotations

import importlib.util
import json
import subprocess

import pytest
import torch

from conftest import PYTHON, TESTS_DIR, child_env

BENCH = TESTS_DIR.parent / "bench" / "delta.py"


def load_bench():
    spec = importlib.util.spec_from_file_location("bench_delta", BENCH)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def awkward_floats(dtype: torch.dtype) -> torch.Tensor:
    """Values whose bits a float round trip could change: NaNs with payloads, -0.0,
    infinities, subnormals, plus ordinary values."""
    ib = {torch.float32: torch.int32, torch.bfloat16: torch.int16}[dtype]
    ordinary = torch.randn(1000, generator=torch.Generator().manual_seed(3)).to(dtype)
    special = torch.tensor([float("nan"), -0.0, 0.0, float("inf"), -float("inf"), 1e-45, -1e-40], dtype=torch.float32).to(dtype)
    t = torch.cat([ordinary, special])
    # A NaN with a payload other than the default one, and a negative one.
    bits = t.view(ib).clone()
    bits[0] = 0x7FC00123 if dtype == torch.float32 else 0x7FC3
    bits[1] = -1  # all ones: a negative NaN
    return bits.view(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_xor_delta_round_trip_is_bit_exact(dtype):
    bench = load_bench()
    base = awkward_floats(dtype)
    cur = base.clone()
    ib = {torch.float32: torch.int32, torch.bfloat16: torch.int16}[dtype]
    cur.view(ib)[::7] += 1  # a one-ulp change in every seventh value, NaNs included
    delta = bench.xor(cur, base)
    assert delta.dtype == dtype and delta.shape == cur.shape
    back = bench.xor(delta, base)
    assert bench.bit_equal(back, cur)
    assert not bench.bit_equal(base, cur)  # the check itself can fail
    # Unchanged values XOR to all-zero bits: what makes the delta compress.
    unchanged = torch.ones(len(cur), dtype=torch.bool)
    unchanged[::7] = False
    assert (delta.view(ib)[unchanged] == 0).all()
    with pytest.raises(ValueError, match="same dtype and shape"):
        bench.xor(cur, base.to(torch.float64))


def test_quick_mode_runs_and_measures(tmp_path):
    out = tmp_path / "delta.json"
    p = subprocess.run([PYTHON, str(BENCH), "--quick", "--out", str(out)], capture_output=True, text=True, timeout=180,
                       env=child_env(), cwd=str(TESTS_DIR.parent))
    assert p.returncode == 0, f"bench/delta.py --quick exited {p.returncode}\n{p.stdout}\n{p.stderr}"
    res = json.loads(out.read_text())
    rows = res["rows"]
    kinds = {r["kind"] for r in rows}
    assert kinds == set(load_bench().KINDS)
    encodings = {r["encoding"] for r in rows}
    assert {"zstd:3", "bytegroup+zstd:3", "xor+zstd:3", "xor+bytegroup+zstd:3", "xor+bytegroup+zstd:9"} <= encodings
    assert all(0 < r["stored_bytes"] <= r["raw_bytes"] for r in rows)

    def stored(kind: str, encoding: str, distance: int | None) -> int:
        (r,) = [r for r in rows if r["phase"] == "late" and r["kind"] == kind and r["encoding"] == encoding
                and r["distance"] == distance]
        return r["stored_bytes"]

    # An embedding table of which a step changes a few rows: its XOR delta is mostly zero
    # bits and must come out far smaller than the step itself (a measurement that did not
    # XOR, or XOR'd the wrong base, would not).
    assert stored("emb-weights", "xor+bytegroup+zstd:3", 1) * 5 < stored("emb-weights", "bytegroup+zstd:3", None)
    assert "XOR pass alone" in p.stdout and "| kind |" in p.stdout
