"""Tiers written in Python (docs/tiers.md): what the Python path costs.

  - per request: the time of one call through the core into a Python tier whose methods do
    nothing but hand back bytes from a dict (a restore of many small chunks, divided by the
    chunks), against the same restore from the Rust fs tier with its file in page cache;
  - persist rate: a save until it is committed on an fsspec `file://` tier, against the
    Rust fs tier, both uncompressed, into the same directory's filesystem.

    python bench/python_tier.py [--mib 64] [--repeat 3] [--dir /var/tmp]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

import tiercel

from _measure import median_time

HERE = Path(__file__).resolve().parent


class DictTier:
    """The least a Python tier can do: objects in a dict."""

    def __init__(self) -> None:
        self.d: dict[str, bytes] = {}

    def put(self, key: str, data: bytes) -> None:
        self.d[key] = data

    def put_if_absent(self, key: str, data: bytes) -> bool:
        return self.d.setdefault(key, data) is data

    def get_range(self, key: str, offset: int, length: int) -> bytes:
        return self.d[key][offset:offset + length]

    def list(self, prefix: str) -> list[str]:
        start = f"{prefix}/" if prefix else ""
        return sorted({k[len(start):].split("/", 1)[0] for k in self.d if k.startswith(start)})

    def delete(self, key: str) -> None:
        self.d.pop(key, None)


def policy(shm: Path, tier: dict, chunk: str) -> dict:
    return {"tier": [{"name": "ram", "kind": "memory", "root": str(shm), "keep": 1},
                     {"name": "t", "every": 1, "keep": 1, "compression": "none", **tier}],
            "restore": {"order": ["t"]}, "store": {"chunk_size": chunk, "threads": 2, "io_threads": 2}}


def persist_seconds(pol: dict, state: dict, repeat: int) -> list[float]:
    """Save to commit on tier "t", `repeat` times after one warm-up save."""
    out = []
    with tiercel.Store(pol, rank=0, world_size=1) as store:
        for step in range(repeat + 1):
            t0 = time.perf_counter()
            store.save(step, state).wait(commit=True)
            out.append(time.perf_counter() - t0)
    return out[1:]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mib", type=int, default=64, help="state size in MiB (default 64)")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--dir", default=os.environ.get("TMPDIR", "/var/tmp"))
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    state = {"w": rng.standard_normal(args.mib << 18).astype(np.float32)}
    nbytes = state["w"].nbytes
    base = Path(tempfile.mkdtemp(prefix="tiercel-bench-pytier-", dir=args.dir))
    shm = Path(tempfile.mkdtemp(prefix="tiercel-bench-pytier-", dir="/dev/shm"))
    sys.modules.setdefault("python_tier_bench", sys.modules[__name__])
    try:
        print(f"state: {nbytes >> 20} MiB float32; {args.repeat} repetitions, medians", flush=True)
        # Per request: 64 KiB chunks, one call each.
        chunk = 64 << 10
        rows = {}
        for i, (label, tier) in enumerate([("python (dict)", {"kind": "python", "factory": "python_tier_bench:DictTier"}),
                                           ("fs (Rust, page cache)", {"kind": "fs", "url": str(base / "fs-small")})]):
            pol = policy(shm / f"r{i}", tier, "64KiB")
            with tiercel.Store(pol, rank=0, world_size=1) as store:
                store.save(1, state).wait(commit=True)
                secs, _ = median_time(lambda: store.reader(1, tiers=["t"]).get_all(), args.repeat)
            rows[label] = secs
            print(f"  restore of {nbytes // chunk} chunks of 64 KiB from {label}: {secs * 1e3:.1f} ms, "
                  f"{secs / (nbytes // chunk) * 1e6:.1f} us per chunk", flush=True)
        extra = (rows["python (dict)"] - rows["fs (Rust, page cache)"]) / (nbytes // chunk)
        print(f"  => a Python tier's overhead per request: {extra * 1e6:.1f} us over the Rust fs tier", flush=True)
        # Persist rate, 4 MiB chunks, uncompressed; the two kinds take turns, so that a load
        # that comes and goes on a shared machine falls on both.
        kinds = [("fs (Rust)", {"kind": "fs", "url": str(base / "fs")}),
                 ("fsspec file://", {"kind": "fsspec", "url": f"file://{base}/fsspec"})]
        samples: dict[str, list[float]] = {label: [] for label, _ in kinds}
        for round_ in range(args.repeat):
            for i, (label, tier) in enumerate(kinds):
                samples[label] += persist_seconds(policy(shm / f"p{round_}-{i}", tier, "4MiB"), state, 1)
        for label, secs in samples.items():
            m = statistics.median(secs)
            rows[label] = m
            print(f"  save until committed on {label}: {m * 1e3:.0f} ms ({nbytes / m / 1e9:.2f} GB/s); samples "
                  + ", ".join(f"{x * 1e3:.0f}" for x in secs), flush=True)
        print(f"  => fsspec file:// persists at {rows['fs (Rust)'] / rows['fsspec file://']:.2f}x the Rust fs tier's rate", flush=True)
    finally:
        shutil.rmtree(base, ignore_errors=True)
        shutil.rmtree(shm, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
