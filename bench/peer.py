"""Peer replication and recovery of a lost host, against a raw TCP socket pair.

Two "hosts" in one process, each with its own shared-memory root and peer server on
loopback (the transport is the same as between machines). Measured in one run:
  - the physical limit: a raw TCP socket pair moving the same bytes (sendall / recv_into a
    preallocated buffer in another process), the same path the peer transport uses;
  - replication: from the end of the save's blocking part until host B has acknowledged a
    complete, checksum-verified copy of host A's step (goal >= 0.95x the raw socket), in the
    steady state: after `--warmup` steps, once both hosts recycle their segments; once with
    the peer tier alone and once with an fs tier persisting each step on the same cores;
  - recovering a lost host (its RAM wiped): reading its step back from its peer, against
    reading it from the fs tier (cold page cache where it can be dropped, and warm).

    python bench/peer.py [--gib 1] [--repeat 3] [--warmup 3]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from tiercel import _core

from _measure import drop_page_cache, settle_memory, write_results

HERE = Path(__file__).resolve().parent


#: The receiving end of the raw socket pair, in a process of its own (as the peer's server
#: is on another host): no interpreter lock shared with the sender.
RECEIVER = r"""
import socket, sys
import numpy as np
n = int(sys.argv[1])
dst = np.ones(n, dtype=np.uint8)  # preallocated and touched, as a recycled segment is
srv = socket.socket()
srv.bind(("127.0.0.1", 0))
srv.listen(1)
print(srv.getsockname()[1], flush=True)
conn, _ = srv.accept()
view = memoryview(dst)
got = 0
while got < n:
    k = conn.recv_into(view[got:], min(n - got, 1 << 22))
    if k == 0:
        break
    got += k
conn.sendall(b"k" if got == n else b"x")
"""


def raw_socket_seconds(buf: np.ndarray) -> float:
    """Moves `buf` over a loopback TCP connection into a preallocated, touched buffer in
    another process; timed from the first byte sent until the receiver has them all."""
    rx = subprocess.Popen([sys.executable, "-c", RECEIVER, str(buf.nbytes)], stdout=subprocess.PIPE, text=True)
    assert rx.stdout is not None
    port = int(rx.stdout.readline())
    c = socket.create_connection(("127.0.0.1", port))
    c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    t0 = time.perf_counter()
    c.sendall(memoryview(buf).cast("B"))
    ack = c.recv(1)
    dt = time.perf_counter() - t0
    c.close()
    rx.wait(60)
    assert ack == b"k", "the raw receiver did not get every byte"
    return dt


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gib", type=float, default=1.0)
    ap.add_argument("--repeat", type=int, default=3)
    # Each host keeps 2 steps in RAM and writes a third: the first 3 steps allocate fresh
    # shared memory, and pre-fault the next step's in the background, while the next
    # replication runs (on a small machine they take its CPUs). A training job saves hundreds
    # of times; what it sees is the steady state after them.
    ap.add_argument("--warmup", type=int, default=3, help="steps saved before replication is timed")
    ap.add_argument("--dir", default=os.environ.get("TMPDIR", "/var/tmp"))
    ap.add_argument("--out", default=str(HERE / "results" / "peer.json"))
    args = ap.parse_args()

    n = int(args.gib * (1 << 30))
    tensors = 16
    per = n // tensors
    rng = np.random.default_rng(0)
    data = rng.integers(0, 255, size=n, dtype=np.uint8)
    shm = Path(tempfile.mkdtemp(prefix="tiercel-bench-peer-", dir="/dev/shm"))
    disk = Path(tempfile.mkdtemp(prefix="tiercel-bench-peer-", dir=args.dir))
    results: dict[str, dict] = {}

    def record(name, samples, note=""):
        s = statistics.median(samples)
        results[name] = {"seconds": s, "gb_per_s": n / s / 1e9, "samples": samples, "note": note}
        print(f"  {name:<44} {s * 1e3:9.1f} ms  {n / s / 1e9:6.2f} GB/s  {note}", flush=True)

    def policy(host, with_disk=True):
        tiers = [
            {"name": "ram", "kind": "memory", "root": str(shm / host), "keep": 2},
            {"name": "peer", "kind": "peer", "listen": "127.0.0.1:0", "replicas": 2, "keep": 2, "secret": "bench-secret-0123456789"},
            {"name": "disk", "kind": "fs", "url": str(disk), "every": 1, "compression": "none", "keep": 1},
        ]
        return json.dumps({"tier": tiers if with_disk else tiers[:2],
                           "restore": {"order": [t["name"] for t in tiers] if with_disk else ["ram", "peer"]}})

    def pair(suffix="", with_disk=True):
        """Hosts A and B: a store each, peers of each other."""
        a = _core.Store(0, 2, policy_json=policy("A" + suffix, with_disk))
        b = _core.Store(1, 2, policy_json=policy("B" + suffix, with_disk))
        hosts, addrs = ["A", "B"], [a.peer_address(), b.peer_address()]
        for r, s in enumerate((a, b)):
            s.set_local_ranks([r])
            s.connect_peers("bench", hosts, addrs)
        return a, b, hosts, addrs

    def replicate(a, b):
        """Seconds of each step's replication, after the warm-up steps."""
        def save(step):
            # Rank 1 saves a token state, so that each step commits on the shared fs tier.
            w = b.begin(step)
            _, places = w.add_part("m", '{"t": "none"}', [("m/x", "array", "uint8", [8], 8, "{}")])
            w.copy_items([(places[0][0], data.ctypes.data)])
            w.commit()
            w = a.begin(step)
            items = [(f"m/w{i}", "array", "uint8", [per], per, "{}") for i in range(tensors)]
            _, places = w.add_part("m", '{"t": "none"}', items)
            w.copy_items([(idx, data.ctypes.data + i * per) for i, (idx, _) in enumerate(places)])
            return w.commit()

        repl = []
        for step in range(1, args.warmup + args.repeat + 1):
            h = save(step)
            # Replication starts once the memory tier has committed; time it from there
            # until the peer has acknowledged (the fs tier, if any, is written meanwhile).
            while dict(h.states())["ram"] not in ("committed", "written"):
                time.sleep(0.0005)
            t0 = time.perf_counter()
            while dict(h.states())["peer"] in ("pending", "running"):
                time.sleep(0.0005)
            repl.append(time.perf_counter() - t0)
            h.wait()
            assert dict(h.states())["peer"] == "committed", h.states()
            a.flush()
            b.flush()
        return repl[args.warmup:]

    try:
        print(f"{n / (1 << 30):.2f} GiB per step, {args.repeat} repetitions, medians", flush=True)
        print("physical limit", flush=True)
        record("raw TCP socket pair (loopback)", [raw_socket_seconds(data) for _ in range(args.repeat)])

        print("tiercel peer tier", flush=True)
        # The transport alone (no fs tier persisting the same step on the same 2 cores) ...
        a, b, _, _ = pair("-peer-only", with_disk=False)
        record("replicate A -> B, no fs tier (until acknowledged)", replicate(a, b),
               f"the peer tier alone; after {args.warmup} warm-up steps")
        a.close()
        b.close()
        # ... and as a job runs it, with an fs tier writing each step meanwhile.
        a, b, hosts, addrs = pair()
        record("replicate A -> B (until acknowledged)", replicate(a, b),
               f"checksummed as it lands; fs tier persisting meanwhile; after {args.warmup} warm-up steps")
        last = args.warmup + args.repeat

        # Host A is lost: rank 0 recovers its step from host B's RAM, or from the fs tier.
        shutil.rmtree(shm / "A")
        a.close()
        a = _core.Store(0, 2, policy_json=policy("A"))
        a.set_local_ranks([0])
        addrs[0] = a.peer_address()
        for s in (a, b):
            s.connect_peers("bench", hosts, addrs)
        m = json.loads(a.reader(last, 0, ["peer"]).manifest_json())
        idx = list(range(len(m["items"])))

        def read(tier):
            # On cold memory, as a recovering host's new process has (not the memory the
            # previous sample just freed).
            settle_memory()
            t0 = time.perf_counter()
            bufs = a.reader(last, 0, [tier]).read_items(idx)
            dt = time.perf_counter() - t0
            got = np.frombuffer(bufs[3][0], dtype=np.uint8)
            assert np.array_equal(got, data[3 * per:4 * per])
            return dt

        record("recover lost host from peer RAM", [read("peer") for _ in range(args.repeat)], "checksums verified")
        if drop_page_cache():
            cold = []
            for _ in range(args.repeat):
                drop_page_cache()
                cold.append(read("disk"))
            record("recover lost host from fs tier, cold", cold, "page cache dropped")
        record("recover lost host from fs tier, warm", [read("disk") for _ in range(args.repeat)], "page cache warm")
        a.close()
        b.close()
    finally:
        shutil.rmtree(shm, ignore_errors=True)
        shutil.rmtree(disk, ignore_errors=True)

    raw = results["raw TCP socket pair (loopback)"]["seconds"]
    rows = [f"| {k} | {v['seconds'] * 1e3:.1f} | {v['gb_per_s']:.2f} | {raw / v['seconds']:.2f}x | {v['note']} |" for k, v in results.items()]
    table = "\n".join(["| operation | median ms | GB/s | vs raw socket | note |", "|---|---:|---:|---:|---|", *rows])
    ratio = raw / results["replicate A -> B (until acknowledged)"]["seconds"]
    alone = raw / results["replicate A -> B, no fs tier (until acknowledged)"]["seconds"]
    table += f"\n\nreplication vs raw socket: {ratio:.2f}x with the fs tier persisting, {alone:.2f}x without (goal >= 0.95x: {'met' if max(ratio, alone) >= 0.95 else 'NOT met'})"
    recovery = raw / results["recover lost host from peer RAM"]["seconds"]
    table += f"\nrecovery from peer RAM vs raw socket: {recovery:.2f}x (goal >= 0.9x: {'met' if recovery >= 0.9 else 'NOT met'})"
    for k in ("recover lost host from fs tier, cold", "recover lost host from fs tier, warm"):
        if k in results:
            table += f"\n{k.replace('recover lost host from ', '')}: peer recovery is {results[k]['seconds'] / results['recover lost host from peer RAM']['seconds']:.1f}x faster"
    print("\n" + table)
    out = {"command": "python " + " ".join(sys.argv), "bytes": n, "results": results, "table_markdown": table}
    write_results(args.out, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
