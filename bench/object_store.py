"""Object-store tier: persist and restore throughput of a 1 GiB state, against boto3's managed
transfer (upload_fileobj / download_fileobj with the same part size and concurrency), on the
same local S3 server in the same run; and what compression (none vs zstd:3) does to the bytes
moved and the time. The physical limit: one TCP connection on 127.0.0.1 with no server.

    python bench/object_store.py [--size-mib 1024] [--server seaweedfs|moto] [--repeat 2]

The server runs on 127.0.0.1 (SeaweedFS by default: moto is pure Python and measures itself
more than the client). Client and server share this machine's cores, so each transfer also
reports the CPU seconds the client process and the server process spent on it: where the two
together fill the cores, the server's own work sets the pace, whichever client drives it.
Every timed transfer starts on cold memory, as after a restart (`_measure.settle_memory`).
Prints the tables and writes bench/results/object_store.json.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import platform
import resource
import shutil
import sys
import time
import uuid
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

import tiercel  # noqa: E402

from _measure import settle_memory  # noqa: E402
from servers import ACCESS_KEY, SECRET_KEY, MotoServer, SeaweedServer  # noqa: E402

MiB = 1 << 20
PART = 16 * MiB
CONCURRENCY = 4


def make_state(total: int, seed: int = 0) -> dict:
    """A training-like state: fp32 weights ~N(0, 0.02) (half), Adam's two moments (a quarter each)."""
    rng = np.random.default_rng(seed)
    n = total // 4
    return {
        "model": {"w": (rng.standard_normal(n // 2, dtype=np.float32) * 0.02)},
        "optim": {
            "exp_avg": rng.standard_normal(n // 4, dtype=np.float32) * 1e-3,
            "exp_avg_sq": np.square(rng.standard_normal(n // 4, dtype=np.float32)) * 1e-6,
        },
    }


def flat_bytes(state: dict) -> bytes:
    return b"".join(a.tobytes() for d in state.values() for a in d.values())


def policy(shm: Path, url: str, endpoint: str, compression: str) -> dict:
    return {
        "tier": [
            # keep 1: a step's segments are recycled for the step after it, as in a long job
            {"name": "ram", "kind": "memory", "root": str(shm), "keep": 1},
            {"name": "s3", "kind": "s3", "url": url, "endpoint": endpoint, "part_size": PART,
             "concurrency": CONCURRENCY, "compression": compression},
        ],
        "restore": {"order": ["ram", "s3"]},
        "store": {"threads": 2, "io_threads": 2},
    }


class CpuMeter:
    """CPU seconds of this process (the client, every thread) and of the server's process
    between `start()` and `stop()`."""

    def __init__(self, server) -> None:
        self.pid = server.proc.pid

    def _now(self) -> tuple[float, float]:
        ru = resource.getrusage(resource.RUSAGE_SELF)
        fields = Path(f"/proc/{self.pid}/stat").read_text().rsplit(")", 1)[1].split()
        server = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
        return ru.ru_utime + ru.ru_stime, server

    def start(self) -> None:
        self.t0 = self._now()

    def stop(self) -> dict:
        c, s = self._now()
        return {"client_cpu_s": c - self.t0[0], "server_cpu_s": s - self.t0[1]}


def tiercel_round(server, bucket: str, state: dict, nbytes: int, compression: str) -> dict:
    cpu = CpuMeter(server)
    prefix = f"bench-{compression.replace(':', '')}-{uuid.uuid4().hex[:6]}"
    shm = Path("/dev/shm") / f"tiercel-bench-{uuid.uuid4().hex[:8]}"
    shm2 = Path("/dev/shm") / f"tiercel-bench-{uuid.uuid4().hex[:8]}"
    pol = policy(shm, f"s3://{bucket}/{prefix}", server.endpoint, compression)
    try:
        with tiercel.Store(pol, rank=0, world_size=1) as store:
            # Step 1's upload runs while the store pre-faults shared memory for the next save
            # (fresh pages: CPU the server would otherwise have); step 2, the one timed, is
            # what every later checkpoint of a job costs.
            store.save(1, state).wait(3600)
            settle_memory()
            t0 = time.perf_counter()
            h = store.save(2, state)
            t_block = time.perf_counter() - t0
            cpu.start()
            states = h.wait(3600)
            t_persist = time.perf_counter() - t0 - t_block
            persist_cpu = cpu.stop()
            assert states["s3"] == "committed", states
        stored = server.client().head_object(Bucket=bucket, Key=f"{prefix}/step-000000000002/rank-00000.data")["ContentLength"]
        pol["tier"][0]["root"] = str(shm2)  # an empty memory tier: the restore reads the bucket
        with tiercel.Store(pol, rank=0, world_size=1) as store:
            settle_memory()
            cpu.start()
            t0 = time.perf_counter()
            got = store.restore(2)
            t_restore = time.perf_counter() - t0
            restore_cpu = cpu.stop()
            assert store.last_restore.tier == "s3", store.last_restore
        for k in state:
            for kk in state[k]:
                assert np.array_equal(got[k][kk].view(np.uint8), state[k][kk].view(np.uint8)), f"{k}.{kk} differs"
        del got
        return {"blocking_s": t_block, "persist_s": t_persist, "restore_s": t_restore, "stored_bytes": stored,
                "persist_cpu": persist_cpu, "restore_cpu": restore_cpu}
    finally:
        shutil.rmtree(shm, ignore_errors=True)
        shutil.rmtree(shm2, ignore_errors=True)
        _delete_prefix(server, bucket, prefix)


def boto3_round(server, bucket: str, data: bytes) -> dict:
    from boto3.s3.transfer import TransferConfig

    cpu = CpuMeter(server)
    c = server.client()
    cfg = TransferConfig(multipart_threshold=PART, multipart_chunksize=PART, max_concurrency=CONCURRENCY, use_threads=True)
    key = f"bench-boto3-{uuid.uuid4().hex[:6]}/state.bin"
    settle_memory()
    cpu.start()
    t0 = time.perf_counter()
    c.upload_fileobj(io.BytesIO(data), bucket, key, Config=cfg)
    t_up = time.perf_counter() - t0
    persist_cpu = cpu.stop()
    out = io.BytesIO()
    settle_memory()
    cpu.start()
    t0 = time.perf_counter()
    c.download_fileobj(bucket, key, out, Config=cfg)
    t_down = time.perf_counter() - t0
    restore_cpu = cpu.stop()
    assert out.getbuffer().nbytes == len(data) and out.getvalue() == data, "boto3 round trip differs"
    c.delete_object(Bucket=bucket, Key=key)
    return {"persist_s": t_up, "restore_s": t_down, "stored_bytes": len(data), "persist_cpu": persist_cpu,
            "restore_cpu": restore_cpu}


def loopback_limit(nbytes: int) -> float:
    """Seconds to push `nbytes` through one TCP connection on 127.0.0.1 with no server logic at
    all: the ceiling of this machine for any client and server that share it."""
    import socket
    import threading

    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(1)
    sink_buf = memoryview(bytearray(4 * MiB))

    def sink() -> None:
        conn, _ = srv.accept()
        with conn:
            while conn.recv_into(sink_buf):
                pass

    t = threading.Thread(target=sink)
    t.start()
    block = memoryview(bytearray(4 * MiB))
    with socket.create_connection(srv.getsockname()) as s:
        t0 = time.perf_counter()
        left = nbytes
        while left > 0:
            n = min(left, len(block))
            s.sendall(block[:n])
            left -= n
    t.join()
    dt = time.perf_counter() - t0
    srv.close()
    return dt


def _delete_prefix(server, bucket: str, prefix: str) -> None:
    c = server.client()
    keys = server.keys(bucket, prefix + "/")
    for i in range(0, len(keys), 1000):
        c.delete_objects(Bucket=bucket, Delete={"Objects": [{"Key": k} for k in keys[i:i + 1000]]})


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size-mib", type=int, default=1024)
    ap.add_argument("--server", choices=["seaweedfs", "moto"], default="seaweedfs")
    ap.add_argument("--repeat", type=int, default=2, help="rounds per method; the best is reported")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "object_store.json"))
    a = ap.parse_args()

    for k in [k for k in os.environ if k.startswith(("AWS_", "GOOGLE_"))]:
        del os.environ[k]
    os.environ.update(AWS_ACCESS_KEY_ID=ACCESS_KEY, AWS_SECRET_ACCESS_KEY=SECRET_KEY, AWS_REGION="us-east-1",
                      AWS_CONFIG_FILE="/nonexistent", AWS_SHARED_CREDENTIALS_FILE="/nonexistent")
    nbytes = a.size_mib * MiB
    state = make_state(nbytes)
    data = flat_bytes(state)
    assert len(data) == nbytes
    # SeaweedFS takes back deleted objects' space only when it vacuums: every round's bytes
    # (boto3's object, two tiercel steps per compression) need volumes of 64 MB of their own.
    volumes = 64 + a.repeat * 5 * -(-nbytes // (64 * MiB))
    server = SeaweedServer(volumes=volumes) if a.server == "seaweedfs" else MotoServer()
    server.start()
    try:
        bucket = server.new_bucket()
        rows: dict[str, list[dict]] = {"tiercel none": [], "tiercel zstd:3": [], "boto3": [], "loopback TCP": []}
        for _ in range(a.repeat):
            lo = loopback_limit(nbytes)
            rows["loopback TCP"].append({"persist_s": lo, "restore_s": lo, "stored_bytes": nbytes})
            rows["boto3"].append(boto3_round(server, bucket, data))
            rows["tiercel none"].append(tiercel_round(server, bucket, state, nbytes, "none"))
            rows["tiercel zstd:3"].append(tiercel_round(server, bucket, state, nbytes, "zstd:3"))
    finally:
        server.stop()

    def best(rs: list[dict], k: str) -> float:
        return min(r[k] for r in rs)

    results = {}
    for name, rs in rows.items():
        results[name] = {
            "persist_s": best(rs, "persist_s"),
            "restore_s": best(rs, "restore_s"),
            "persist_MBps": nbytes / best(rs, "persist_s") / 1e6,
            "restore_MBps": nbytes / best(rs, "restore_s") / 1e6,
            "stored_bytes": rs[0]["stored_bytes"],
            "blocking_s": best(rs, "blocking_s") if "blocking_s" in rs[0] else None,
            # Of the fastest round of each transfer, the one the MB/s come from.
            "persist_cpu": min(rs, key=lambda r: r["persist_s"]).get("persist_cpu"),
            "restore_cpu": min(rs, key=lambda r: r["restore_s"]).get("restore_cpu"),
            "runs": rs,
        }
    b = results["boto3"]
    print(f"\nObject store: {a.size_mib} MiB state, {a.server} on 127.0.0.1, part {PART // MiB} MiB, "
          f"concurrency {CONCURRENCY}, best of {a.repeat}; {os.cpu_count()} cores shared")
    print(f"{'method':<16}{'persist MB/s':>14}{'vs boto3':>10}{'restore MB/s':>14}{'vs boto3':>10}{'stored MiB':>12}{'ratio':>8}")
    for name, r in results.items():
        print(f"{name:<16}{r['persist_MBps']:>14.0f}{r['persist_MBps'] / b['persist_MBps']:>9.2f}x"
              f"{r['restore_MBps']:>14.0f}{r['restore_MBps'] / b['restore_MBps']:>9.2f}x"
              f"{r['stored_bytes'] / MiB:>12.0f}{nbytes / r['stored_bytes']:>8.3f}")
    cores = os.cpu_count() or 1
    print(f"\nCPU seconds per GiB moved, of the same rounds (client: this process; server: {a.server}); "
          f"busy: both together, of {cores} cores")
    print(f"{'method':<16}{'persist client':>15}{'server':>8}{'busy':>6}{'restore client':>16}{'server':>8}{'busy':>6}")
    for name, r in results.items():
        if not r["persist_cpu"]:
            continue
        row = f"{name:<16}"
        for op, width in (("persist", 15), ("restore", 16)):
            c, secs = r[f"{op}_cpu"], r[f"{op}_s"]
            per_gib = (1 << 30) / nbytes
            busy = (c["client_cpu_s"] + c["server_cpu_s"]) / (secs * cores)
            row += f"{c['client_cpu_s'] * per_gib:>{width}.2f}{c['server_cpu_s'] * per_gib:>8.2f}{busy:>6.0%}"
        print(row)
    lo, t = results["loopback TCP"], results["tiercel none"]
    print(f"loopback TCP is the ceiling (one connection, no server): tiercel none reaches "
          f"{t['persist_MBps'] / lo['persist_MBps']:.0%} of it on persist, {t['restore_MBps'] / lo['restore_MBps']:.0%} on restore")
    out = {
        "bench": "object_store",
        "size_bytes": nbytes,
        "server": a.server,
        "part_size": PART,
        "concurrency": CONCURRENCY,
        "repeat": a.repeat,
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform()},
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "results": results,
    }
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(out, indent=2) + "\n")
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
