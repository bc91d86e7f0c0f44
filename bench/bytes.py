"""Storing unchanged chunks once (format version 3, policy `dedup`): bytes, requests, time.

Issue 31 item 5. Three workloads are trained here with torch on CPU, a real AdamW step
between saves (bench/_bytes_workloads.py):

  - lora:  a frozen float32 base of 256 MiB (requires_grad=False: the same bytes every step),
           a rank-16 adapter of 4 MiB and its AdamW moments;
  - moe:   16 experts (4 MiB each), a router and shared projections; each step routes to a
           quarter of the experts, drawn at random, so only they (and the shared parts) change;
  - dense: an MLP of 64 MiB, every parameter changing every step.

Every step's {"model": state_dict, "optim": moments} is saved by a plain `tiercel.Store`
with a memory tier (required first) and one durable tier that gets every step (`keep`
unlimited): fs (a directory under --dir, on disk), s3 on moto, and in the full run s3 on
SeaweedFS too, each with `dedup = true` and `dedup = false`. Each configuration trains
its workload from the same seed (the same states) into a fresh directory or bucket, deleted
once measured (each workload and S3 server kind gets a fresh server). Per step:

  - bytes written: fs, the sizes of the files that are new or changed in the tier's
    directory since the last step; s3, the same over a listing of the bucket (key, size,
    ETag). Nothing is removed (`keep` unlimited), which the run checks;
  - requests by kind (s3): the tier's own counters, `store.metrics()` (every request its
    client sent, retries included);
  - persist seconds: the tier's `write_seconds` (the background write of the step), and the
    wall time from `save` to `flush` returning; `save` alone is the blocking part.

Then a fresh Store (an empty memory tier) restores the newest step and step 1 from the
durable tier alone, timed, and every tensor must equal the one saved, bit for bit.

In the same run, the limits and alternatives: the disk's write rate (write + fsync of the
step's bytes in one file, in --dir), `torch.save` of the state to --dir (+ fsync), boto3's
`put_object` of the step's bytes as one object on each S3 server, and the rate of the hashing
a save does for each chunk (CRC32C and XXH3-128 in one pass, `tiercel._core.crc32c_and_hash`,
4 MiB chunks on one core) beside one core's memcpy of the same bytes, its limit. Chunks are stored raw (`compression = "none"`, --compression):
random-initialised weights do not compress, and dedup is what is measured.

    python bench/bytes.py [--steps 10] [--tiers fs,moto,seaweedfs] [--quick]

--quick: a 16 MiB base, 8 MiB models, 3 steps, fs and moto (well under a minute; what
tests/test_bytes_bench.py runs). Writes bench/results/bytes.{json,md,png} (bytes-quick.*).
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

import tiercel
from tiercel import _core

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "tests"))
from _bytes_report import GOALS, markdown, plot  # noqa: E402
from _bytes_workloads import WORKLOADS, flat, make, snapshot, state_bytes  # noqa: E402
from _measure import write_results  # noqa: E402
from servers import ACCESS_KEY, SECRET_KEY, MotoServer, SeaweedServer  # noqa: E402

REQUESTS = ("get", "put", "list", "head", "delete", "part", "multipart")
TIER = "durable"


def log(msg: str) -> None:
    print(msg, flush=True)


def raw(t: Any) -> np.ndarray:
    """The bytes of a tensor or array, as uint8."""
    if isinstance(t, torch.Tensor):
        return t.detach().contiguous().reshape(-1).view(torch.uint8).numpy()
    return np.ascontiguousarray(t).reshape(-1).view(np.uint8)


def identical(got: dict[str, Any], want: dict[str, torch.Tensor]) -> bool:
    g = flat(got)
    return g.keys() == want.keys() and all(np.array_equal(raw(g[k]), raw(want[k])) for k in want)


# -- what a tier holds ------------------------------------------------------------------------


def fs_listing(root: Path) -> dict[str, tuple[int, int]]:
    out = {}
    for p in root.rglob("*"):
        if p.is_file():
            st = p.stat()
            out[str(p.relative_to(root))] = (st.st_size, st.st_mtime_ns)
    return out


def s3_listing(client: Any, bucket: str) -> dict[str, tuple[int, str]]:
    out = {}
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket):
        for o in page.get("Contents", []):
            out[o["Key"]] = (o["Size"], o["ETag"])
    return out


def written(before: dict, after: dict) -> tuple[int, int, int]:
    """(bytes in objects new or changed, their number, objects removed) between two listings."""
    new = [k for k, v in after.items() if before.get(k) != v]
    return sum(after[k][0] for k in new), len(new), len(before.keys() - after.keys())


# -- one configuration --------------------------------------------------------------------------


class Place:
    """Where a configuration's durable tier lives: a directory of its own, or a bucket of its
    own on `server`; `stop()` removes it and all it holds."""

    def __init__(self, kind: str, work: Path, tag: str, server: MotoServer | SeaweedServer | None) -> None:
        self.kind, self.server = kind, server
        if server is None:
            self.root = Path(tempfile.mkdtemp(prefix=f"tier-{tag}-", dir=work))
            self.server_name = "local disk"
        else:
            self.server_name = kind
            self.client = server.client()
            self.bucket = server.new_bucket()

    def tier(self, dedup: bool, compression: str) -> dict[str, Any]:
        common = {"name": TIER, "compression": compression, "dedup": dedup}
        if self.server is None:
            return {**common, "kind": "fs", "url": str(self.root)}
        return {**common, "kind": "s3", "url": f"s3://{self.bucket}/bytes", "endpoint": self.server.endpoint, "allow_http": True}

    def listing(self) -> dict:
        return fs_listing(self.root) if self.server is None else s3_listing(self.client, self.bucket)

    def stop(self) -> None:
        if self.server is None:
            shutil.rmtree(self.root, ignore_errors=True)
            return
        keys = list(s3_listing(self.client, self.bucket))
        for i in range(0, len(keys), 1000):
            self.client.delete_objects(Bucket=self.bucket, Delete={"Objects": [{"Key": k} for k in keys[i:i + 1000]]})
        self.client.delete_bucket(Bucket=self.bucket)


def start_server(kind: str) -> MotoServer | SeaweedServer | None:
    """A fresh S3 server for one workload's configurations (None for fs): what the last
    workload left (SeaweedFS frees deleted objects' space only when it vacuums) is gone."""
    if kind == "fs":
        return None
    server = MotoServer() if kind == "moto" else SeaweedServer(volumes=512)
    server.start()
    return server


def policy(shm: Path, tier: dict[str, Any]) -> dict[str, Any]:
    # The first tier must be the memory tier; one step there is all a save needs.
    return {"tier": [{"name": "ram", "kind": "memory", "root": str(shm), "keep": 1}, tier]}


def tier_metrics(store: tiercel.Store) -> dict[str, Any]:
    return dict(store.metrics()[TIER])


def run_config(name: str, kind: str, dedup: bool, a: argparse.Namespace, work: Path,
               server: MotoServer | SeaweedServer | None) -> dict[str, Any]:
    tag = f"{name}-{kind}-{'dedup' if dedup else 'whole'}"
    wl = make(name, a.quick)
    place = Place(kind, work, tag, server)
    shm = Path(tempfile.mkdtemp(prefix=f"tiercel-bench-bytes-{tag}-", dir="/dev/shm"))
    rows: list[dict[str, Any]] = []
    out: dict[str, Any] = {"workload": name, "tier": "fs" if kind == "fs" else "s3", "server": place.server_name,
                           "dedup": dedup, **wl.describe()}
    try:
        pol = policy(shm, place.tier(dedup, a.compression))
        with tiercel.Store(pol, rank=0, world_size=1) as store:
            seen = place.listing()
            for step in range(1, a.steps + 1):
                loss = wl.step()
                state = wl.state()
                if step == 1:
                    first = snapshot(state)
                m0 = tier_metrics(store)
                t0 = time.perf_counter()
                handle = store.save(step, state)
                t_save = time.perf_counter() - t0
                store.flush()
                t_flush = time.perf_counter() - t0
                got = handle.wait(600)
                if got.get(TIER) != "committed":
                    raise RuntimeError(f"bench/bytes.py: {tag}: step {step}: {got}")
                m1 = tier_metrics(store)
                now = place.listing()
                nbytes, objects, removed = written(seen, now)
                seen = now
                row = {"step": step, "loss": loss, "state_bytes": state_bytes(state), "bytes_written": nbytes,
                       "objects_written": objects, "objects_removed": removed, "save_s": t_save, "save_to_flush_s": t_flush,
                       "persist_s": m1["write_seconds"] - m0["write_seconds"]}
                if kind != "fs":
                    row["requests"] = {k: (m1[f"requests_{k}"] or 0) - (m0[f"requests_{k}"] or 0) for k in REQUESTS}
                rows.append(row)
                reqs = f", {sum(row['requests'].values())} requests" if kind != "fs" else ""
                log(f"  {tag} step {step}: wrote {nbytes / 2**20:.1f} MiB of {row['state_bytes'] / 2**20:.1f} "
                    f"in {row['persist_s']:.2f} s{reqs}")
            newest = snapshot(wl.state())
        out["steps"] = rows
        out["restore"] = {}
        for label, step, want in (("newest", a.steps, newest), ("old", 1, first)):
            ram = Path(tempfile.mkdtemp(prefix=f"tiercel-bench-bytes-restore-{tag}-", dir="/dev/shm"))
            try:
                with tiercel.Store(policy(ram, place.tier(dedup, a.compression)), rank=0, world_size=1) as fresh:
                    t0 = time.perf_counter()
                    got = fresh.restore(step=step)
                    seconds = time.perf_counter() - t0
                    same = identical(got, want)
                    del got
            finally:
                shutil.rmtree(ram, ignore_errors=True)
            if not same:
                raise RuntimeError(f"bench/bytes.py: {tag}: step {step} did not restore bit for bit")
            out["restore"][label] = {"step": step, "seconds": seconds, "identical": same}
            log(f"  {tag} restore of step {step} ({label}) from {place.server_name}: {seconds:.2f} s, bit-identical")
        out["held_bytes"] = sum(v[0] for v in place.listing().values())
    finally:
        place.stop()
        shutil.rmtree(shm, ignore_errors=True)
    return out


# -- limits and alternatives ----------------------------------------------------------------


def tensors_of(name: str, quick: bool) -> tuple[list[np.ndarray], dict[str, Any], int]:
    """A workload's state after two steps: its tensors' bytes, the state, its size."""
    wl = make(name, quick)
    wl.step()
    wl.step()
    state = wl.state()
    arrays = [raw(t) for t in flat(state).values()]
    return arrays, state, sum(x.nbytes for x in arrays)


def disk_write(arrays: list[np.ndarray], where: Path) -> float:
    """Seconds to write the bytes into one file and fsync it."""
    path = where / "raw-write.bin"
    t0 = time.perf_counter()
    with open(path, "wb") as f:
        for x in arrays:
            f.write(x)
        f.flush()
        os.fsync(f.fileno())
    seconds = time.perf_counter() - t0
    path.unlink()
    return seconds


def torch_save(state: dict[str, Any], where: Path) -> float:
    path = where / "torch-save.pt"
    t0 = time.perf_counter()
    with open(path, "wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())
    seconds = time.perf_counter() - t0
    path.unlink()
    return seconds


def boto3_put(server: MotoServer | SeaweedServer, arrays: list[np.ndarray], repeat: int) -> float:
    """Median seconds of boto3's put_object of the bytes as one object."""
    body = b"".join(x.tobytes() for x in arrays)
    client, bucket = server.client(), server.new_bucket()
    times = []
    for i in range(repeat):
        t0 = time.perf_counter()
        client.put_object(Bucket=bucket, Key=f"put-{i}", Body=body)
        times.append(time.perf_counter() - t0)
        client.delete_object(Bucket=bucket, Key=f"put-{i}")
    client.delete_bucket(Bucket=bucket)
    return statistics.median(times)


def pass_rate(arrays: list[np.ndarray], each: Callable[[np.ndarray], object], chunk: int = 4 << 20) -> float:
    """GB/s of `each` over the bytes in `chunk`-sized pieces, one core (best of 5: on a shared
    machine the other processes slow some passes)."""
    pieces = [x[i:i + chunk] for x in arrays for i in range(0, x.nbytes, chunk)]
    total = sum(p.nbytes for p in pieces)
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        for p in pieces:
            each(p)
        best = min(best, time.perf_counter() - t0)
    return total / best / 1e9


def hash_rate(arrays: list[np.ndarray]) -> float:
    """The hashing a save does per chunk: CRC32C and XXH3-128 in one pass."""
    return pass_rate(arrays, _core.crc32c_and_hash)


def memcpy_rate(arrays: list[np.ndarray]) -> float:
    """The physical limit beside it: one core copying the same bytes (into one buffer that
    stays in cache, so that the rate is the reading's)."""
    dst = np.empty(4 << 20, np.uint8)
    return pass_rate(arrays, lambda p: np.copyto(dst[:p.nbytes], p))


def limits(name: str, a: argparse.Namespace, work: Path) -> tuple[dict[str, Any], list[np.ndarray]]:
    """The disk's, torch.save's and the hashing's numbers for a workload's step; its bytes."""
    arrays, state, nbytes = tensors_of(name, a.quick)
    out: dict[str, Any] = {"state_bytes": nbytes, "hash_gb_s": hash_rate(arrays), "memcpy_gb_s": memcpy_rate(arrays),
                           "disk_write_fsync_s": statistics.median(disk_write(arrays, work) for _ in range(a.repeat)),
                           "torch_save_fsync_s": statistics.median(torch_save(state, work) for _ in range(a.repeat))}
    log(f"  {name}: {nbytes / 2**20:.1f} MiB a step; hashing {out['hash_gb_s']:.2f} GB/s on one core "
        f"(memcpy {out['memcpy_gb_s']:.2f}); "
        f"write + fsync {out['disk_write_fsync_s']:.3f} s, torch.save + fsync {out['torch_save_fsync_s']:.3f} s")
    return out, arrays


# -- the run --------------------------------------------------------------------------------


def free_bytes(path: Path) -> int:
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=None, help="saves per configuration (default 10; --quick 3)")
    ap.add_argument("--tiers", default=None, help="fs, moto, seaweedfs (default all three; --quick fs,moto)")
    ap.add_argument("--workloads", default=",".join(WORKLOADS))
    ap.add_argument("--compression", default="none", help="the durable tier's compression")
    ap.add_argument("--dir", default="/var/tmp", help="where the fs tier, the raw writes and torch.save go (on disk)")
    ap.add_argument("--quick", action="store_true", help="small models, 3 steps, fs and moto: well under a minute")
    ap.add_argument("--out", default=None, help="results prefix (default bench/results/bytes, or bytes-quick)")
    a = ap.parse_args()
    a.steps = a.steps or (3 if a.quick else 10)
    a.repeat = 1 if a.quick else 3
    tiers = (a.tiers or ("fs,moto" if a.quick else "fs,moto,seaweedfs")).split(",")
    names = a.workloads.split(",")
    out_prefix = a.out or str(HERE / "results" / ("bytes-quick" if a.quick else "bytes"))
    # The servers and tiercel's s3 tier take their credentials from the environment only.
    os.environ.update({"AWS_ACCESS_KEY_ID": ACCESS_KEY, "AWS_SECRET_ACCESS_KEY": SECRET_KEY, "AWS_REGION": "us-east-1",
                       "AWS_CONFIG_FILE": "/nonexistent", "AWS_SHARED_CREDENTIALS_FILE": "/nonexistent"})
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # the finally blocks stop servers, remove data
    torch.set_num_threads(1)  # the machine may be shared; and the same states in every configuration
    Path(a.dir).mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="tiercel-bench-bytes-", dir=a.dir))
    load0 = os.getloadavg()[0]
    log(f"bench/bytes.py: {a.steps} steps, workloads {names}, tiers {tiers}; free: {free_bytes(work) / 2**30:.1f} GiB "
        f"in {a.dir}, {free_bytes(Path('/dev/shm')) / 2**30:.1f} GiB in /dev/shm")
    t_start = time.perf_counter()
    res: dict[str, Any] = {"benchmark": "bytes", "date": time.strftime("%Y-%m-%d %H:%M"), "quick": a.quick,
                           "steps": a.steps, "compression": a.compression, "configs": [], "limits": {}}
    try:
        for name in names:
            log(f"{name}: limits and alternatives")
            lim, arrays = limits(name, a, work)
            res["limits"][name] = lim
            need = lim["state_bytes"] * a.steps * 1.1
            for kind in tiers:
                server = start_server(kind)
                try:
                    if server is not None:
                        lim[f"boto3_put_s_{kind}"] = boto3_put(server, arrays, a.repeat)
                        log(f"  {name}: boto3 put_object on {kind} {lim[f'boto3_put_s_{kind}']:.3f} s")
                    for dedup in (False, True):
                        if free_bytes(work) < need:
                            raise SystemExit(f"bench/bytes.py: {need / 2**30:.1f} GiB needed in {a.dir}, "
                                             f"{free_bytes(work) / 2**30:.1f} free")
                        log(f"{name} on {kind}, dedup {'on' if dedup else 'off'}")
                        res["configs"].append(run_config(name, kind, dedup, a, work, server))
                finally:
                    if server is not None:
                        server.stop()
            del arrays
    finally:
        shutil.rmtree(work, ignore_errors=True)
    res["run_s"] = time.perf_counter() - t_start
    res["environment"] = {"machine": platform.machine(), "cpus": os.cpu_count(), "torch": torch.__version__,
                          "tiercel_format": tiercel.FORMAT_VERSION, "loadavg_1min_start": load0,
                          "loadavg_1min_end": os.getloadavg()[0]}
    md = markdown(res)
    log("\n" + md)
    write_results(out_prefix + ".json", res)
    Path(out_prefix + ".md").write_text(md + "\n")
    if plot(res, out_prefix + ".png"):
        log(f"wrote {out_prefix}.png")
    else:
        log("matplotlib is missing: pip install -r requirements-bench.txt for the plot")
    failed = [g for g in GOALS(res) if g[2] is False]
    log(f"done in {res['run_s']:.0f} s; goals missed: {len(failed)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
