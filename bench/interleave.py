"""Does checkpoint traffic slow training? Step time of a 2-host DDP job (gloo) over shaped
links, with a peer tier replicating a checkpoint every step, for: no checkpointing; the save
without replication (a memory tier only: what the copy into shared memory costs); the
traffic scheduler off (naive); mode "signals"; mode "learned".

Hosts are Linux network namespaces on one bridge (tests/netns.py), each host's link shaped
with `tc tbf` to `--rate`. Each step: `--compute-ms` of forward compute (the network is
idle), then `--backward-ms` of backward compute over `--buckets` layers, each layer's
gradient one DDP bucket whose all-reduce (`--grad-mb` in all) runs while the layers below
compute, as DDP overlaps them (`--pattern fsdp`: a collective of each layer's bytes before
its forward and after its backward compute, as FSDP without prefetching runs them, so the
link is idle in many short spans); then `store.save` of `--ckpt-mb` (copied to shared memory;
the peer tier replicates it to the other host in the background). Compute sleeps (a GPU
leaves the host's cores free; `--spin` keeps a core busy instead). In the same run: the raw
TCP throughput of the shaped link (the physical limit) and the idle spans of the step
without checkpoints (its learned profile).

    sudo /root/.cache/tiercel/venv/bin/python bench/interleave.py --steps 60 --rate 1gbit
    sudo ... bench/interleave.py --rate 1gbit,200mbit --ckpt-mb 8,16,24,32,48,100   # a sweep
    sudo ... bench/interleave.py --steps 10 --grad-mb 2 --ckpt-mb 8 --rate 200mbit   # small

Writes bench/results/interleave.json and, for one size and rate, a timeline PNG (--png) of
a few iterations per mode: when training communication and checkpoint chunks used the link.
Needs root (namespaces, tc) and matplotlib (requirements-bench.txt). Every namespace is
removed at the end, also on failure or Ctrl-C.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests"))
sys.path.insert(0, str(HERE))

from _measure import write_results  # noqa: E402
from netns import Net, unavailable  # noqa: E402

MODES = ["nockpt", "local", "off", "signals", "learned"]
LABELS = {"nockpt": "no checkpoint", "local": "save, no replication", "off": "scheduler off (naive)",
          "signals": "signals", "learned": "learned"}
PYTHON = sys.executable


def shape(net: Net, rate: str, slow_start_after_idle: bool = True) -> None:
    """Every host's egress to `rate` (tc tbf): a host sends no faster than its link. Without
    `slow_start_after_idle`, a connection idle for a moment keeps its congestion window
    (the namespace's net.ipv4.tcp_slow_start_after_idle = 0)."""
    for i in range(net.n):
        subprocess.run([*net.exec_prefix(i), "tc", "qdisc", "replace", "dev", "eth0", "root", "tbf", "rate", rate,
                        "burst", "256kb", "latency", "100ms"], check=True, capture_output=True)
        subprocess.run([*net.exec_prefix(i), "sysctl", "-q", "-w",
                        f"net.ipv4.tcp_slow_start_after_idle={int(slow_start_after_idle)}"], check=True, capture_output=True)


def raw_throughput(net: Net, nbytes: int) -> float:
    """Bytes per second of one TCP stream host 0 -> host 1 over the shaped link."""
    port = 29611
    server = subprocess.Popen([*net.exec_prefix(1), PYTHON, "-c", (
        "import socket,sys\n"
        f"s=socket.create_server(('{net.addr(1)}',{port}));c,_=s.accept();n=0\n"
        "while True:\n d=c.recv(1<<20)\n if not d: break\n n+=len(d)\n"
        "c.sendall(b'k')\n")])
    try:
        code = (
            "import socket,time\n"
            f"buf=b'x'*(1<<20);c=socket.create_connection(('{net.addr(1)}',{port}),timeout=60)\n"
            f"t=time.perf_counter()\nfor _ in range({nbytes >> 20}): c.sendall(buf)\n"
            "c.shutdown(socket.SHUT_WR);c.recv(1);print(time.perf_counter()-t)\n")
        for _ in range(50):
            r = subprocess.run([*net.exec_prefix(0), PYTHON, "-c", code], capture_output=True, text=True)
            if r.returncode == 0:
                return (nbytes >> 20 << 20) / float(r.stdout)
            time.sleep(0.1)  # the server is not listening yet
        raise RuntimeError(f"raw socket test failed: {r.stderr}")
    finally:
        server.kill()
        server.wait()


def run_mode(net: Net, mode: str, ckpt_mb: int, args: argparse.Namespace, out: Path, shm: str) -> list[dict]:
    cfg = {"mode": mode, "steps": args.steps, "grad_mb": args.grad_mb, "ckpt_mb": ckpt_mb,
           "compute_s": args.compute_ms / 1e3, "backward_s": args.backward_ms / 1e3, "buckets": args.buckets,
           "spin": args.spin, "pattern": args.pattern, "chunk": args.chunk, "warmup": args.warmup, "mu": args.mu,
           "shm": shm, "addrs": [net.addr(i) for i in range(net.n)], "out": str(out)}
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = []
    try:
        for rank in range(net.n):
            env = {**os.environ, "MASTER_ADDR": net.addr(0), "MASTER_PORT": str(port), "RANK": str(rank),
                   "WORLD_SIZE": str(net.n), "GLOO_SOCKET_IFNAME": "eth0", "TIERCEL_HOST": f"host{rank}",
                   "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join([str(HERE.parent / "python"), str(HERE),
                                                                         os.environ.get("PYTHONPATH", "")])}
            procs.append(subprocess.Popen([*net.exec_prefix(rank), PYTHON, str(HERE / "_interleave_worker.py"),
                                           json.dumps(cfg)], env=env))
        deadline = time.monotonic() + args.timeout
        for p in procs:
            p.wait(max(1, deadline - time.monotonic()))
            if p.returncode != 0:
                raise RuntimeError(f"mode {mode}: a rank exited with {p.returncode}")
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return [json.loads((out / f"{mode}-{r}.json").read_text()) for r in range(net.n)]


def summary(times: list[float], skip: int) -> dict:
    t = sorted(times[skip:]) or sorted(times)
    return {"median_s": statistics.median(t), "p95_s": t[min(len(t) - 1, int(0.95 * len(t)))], "steps": len(t)}


def busy_intervals(tl: list) -> list[tuple[float, float]]:
    """(start, end) of every training-communication interval of a timeline."""
    out, since = [], None
    for t, kind, *_ in tl:
        if kind == "busy":
            since = t
        elif kind == "idle" and since is not None:
            out.append((since, t))
            since = None
    return out


def overlap(tl: list, after: float) -> float | None:
    """Share of the peer link's checkpoint-chunk time (admitted .. sent, as the sender saw
    it) that overlapped training communication, from `after` on; None without chunks."""
    busy = [b for b in busy_intervals(tl) if b[1] >= after]
    total = hit = 0.0
    for t, kind, link, _n, sec in tl:
        if kind != "chunk" or link != "peer" or sec is None or t < after:
            continue
        total += sec
        hit += sum(max(0.0, min(t + sec, e) - max(t, s)) for s, e in busy)
    return hit / total if total > 0 else None


def geometry(profile: dict | None) -> str:
    """The idle spans of one iteration, as the learned profile saw them."""
    if not profile:
        return "no profile"
    spans = ", ".join(f"{o * 1e3:.0f}+{length * 1e3:.0f}" for o, length, _ in profile["spans"])
    idle = sum(length for _, length, _ in profile["spans"])
    return f"iteration {profile['iteration'] * 1e3:.0f} ms, idle {idle * 1e3:.0f} ms in spans (offset+length ms) {spans}"


def plot(reports: dict[str, list[dict]], path: str, iterations: int, title: str) -> None:
    """Per mode (naive and learned), a few iterations of rank 0's link: training
    communication (busy..idle) and checkpoint chunks (admitted .. sent)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    modes = [m for m in ("off", "signals", "learned") if m in reports]
    fig, axes = plt.subplots(len(modes), 1, figsize=(11, 1.8 * len(modes) + 0.6), squeeze=False)
    for ax, mode in zip(axes[:, 0], modes):
        tl = reports[mode][0]["timeline"]
        its = [e[0] for e in tl if e[1] == "iteration"]
        if len(its) < iterations + 2:
            ax.set_title(f"{LABELS[mode]}: too few iterations recorded")
            continue
        # The last few iterations: the learned schedule is on by then.
        a, b = its[-iterations - 1], its[-1]
        busy, since = [], None
        for t, kind, *_ in tl:
            if kind == "busy":
                since = t
            elif kind == "idle" and since is not None:
                busy.append((since, t - since))
                since = None
        bw = reports[mode][0]["stats"]["links"]["peer"].get("bandwidth") or 1e9
        chunks = [(t, s if s is not None else n / bw) for t, kind, link, n, s in tl if kind == "chunk" and link == "peer"]
        ax.broken_barh([(s - a, d) for s, d in busy if a <= s <= b], (10, 8), color="tab:blue", label="training all-reduce")
        ax.broken_barh([(s - a, d) for s, d in chunks if a <= s <= b], (0, 8), color="tab:orange", label="checkpoint chunk")
        for t in its:
            if a <= t <= b:
                ax.axvline(t - a, color="grey", lw=0.5)
        ax.set_yticks([4, 14], ["checkpoint", "training"])
        ax.set_xlim(0, b - a)
        ax.set_title(f"{LABELS[mode]} (rank 0's link, last {iterations} iterations)", fontsize=9)
    axes[-1, 0].set_xlabel("seconds")
    fig.suptitle(title, fontsize=9)
    axes[0, 0].legend(loc="upper right", fontsize=7)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


def measure(net: Net, rate: str, ckpt_mb: int, modes: list[str], args: argparse.Namespace,
            skip: int, nockpt: dict | None) -> tuple[dict, dict[str, list[dict]]]:
    """Every mode at one rate and checkpoint size; `nockpt`: the no-checkpoint result of this
    rate when it was measured already (it does not depend on the size)."""
    reports: dict[str, list[dict]] = {}
    with tempfile.TemporaryDirectory(prefix="tiercel-interleave-") as tmp, \
            tempfile.TemporaryDirectory(prefix="tiercel-interleave-", dir="/dev/shm") as shm:
        for mode in modes:
            if mode == "nockpt" and nockpt is not None:
                continue
            reports[mode] = run_mode(net, mode, ckpt_mb, args, Path(tmp), shm)
            if args.keep:
                keep = Path(args.keep) / f"{rate}-{ckpt_mb}-{mode}.json"
                keep.parent.mkdir(parents=True, exist_ok=True)
                keep.write_text(json.dumps(reports[mode]))
    results = {} if nockpt is None else {"nockpt": nockpt}
    for mode, reps in reports.items():
        # The job's step time: the slower rank's.
        per_rank = [summary(r["times"], skip) for r in reps]
        s = max(per_rank, key=lambda x: x["median_s"])
        peer = reps[0].get("peer") or {}
        stats = reps[0]["stats"]
        link = stats["links"].get("peer") or {}
        tl = reps[0]["timeline"]
        its = [e[0] for e in tl if e[1] == "iteration"]
        results[mode] = {**s, "waits": stats["waits"], "wait_seconds": stats["wait_seconds"],
                         "replicated_steps": peer.get("steps_written"), "skips": peer.get("skips"),
                         "plan": link.get("plan"), "alpha": link.get("alpha"), "bandwidth": link.get("bandwidth"),
                         "profile": stats["profile"],
                         "overlap": overlap(tl, its[min(skip, len(its) - 1)] if its else 0.0)}
    return results, reports


def row(rate: str, ckpt_mb: int, results: dict) -> str:
    base = results.get("nockpt", {}).get("median_s")
    cells = []
    for mode in MODES[1:]:
        r = results.get(mode)
        if r is None:
            cells.append("-")
            continue
        rel = f", {r['median_s'] / base:.2f}x" if base else ""
        extra = ""
        if mode != "local":
            ov = r["overlap"]
            extra = f", overlap {ov:.0%}" if ov is not None else ""
        plan = r["plan"] or {}
        if plan.get("effective_interval", 1) > 1:
            extra += f", interval {plan['effective_interval']}"
        cells.append(f"{r['median_s'] * 1e3:.0f} ({r['p95_s'] * 1e3:.0f}){rel}{extra}")
    b = results.get("nockpt")
    base_cell = f"{b['median_s'] * 1e3:.0f} ({b['p95_s'] * 1e3:.0f})" if b else "-"
    return f"| {rate} | {ckpt_mb} MiB | {base_cell} | " + " | ".join(cells) + " |"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--rate", default="1gbit", help="tc rate of every host's link, or several (1gbit,200mbit)")
    ap.add_argument("--grad-mb", type=int, default=20, help="MiB all-reduced per step")
    ap.add_argument("--ckpt-mb", default="100", help="MiB saved (and replicated) per step, or several (8,24,100)")
    ap.add_argument("--compute-ms", type=float, default=100.0, help="forward compute per step (idle network)")
    ap.add_argument("--backward-ms", type=float, default=None, help="backward compute per step (default: 2x forward)")
    ap.add_argument("--buckets", type=int, default=4, help="layers, one DDP gradient bucket each")
    ap.add_argument("--spin", action="store_true", help="compute keeps a core busy instead of sleeping")
    ap.add_argument("--pattern", choices=["ddp", "fsdp"], default="ddp",
                    help="ddp: bucket all-reduces overlap backward; fsdp: a collective per layer in forward and "
                         "backward, each between two layers' compute (many short idle spans)")
    ap.add_argument("--chunk", default="1MiB", help="[store] chunk_size")
    ap.add_argument("--warmup", type=int, default=10, help="[traffic] warmup iterations")
    ap.add_argument("--no-slow-start-after-idle", action="store_true",
                    help="hosts keep a connection's congestion window across idle spans (sysctl, per namespace)")
    ap.add_argument("--mu", type=float, default=None, help="[traffic] mu (default: the policy's, 0.8)")
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--timeout", type=float, default=1800)
    ap.add_argument("--out", default=str(HERE / "results" / "interleave.json"))
    ap.add_argument("--keep", default="", help="a folder for every run's raw reports (timelines, stats)")
    ap.add_argument("--png", default=str(HERE / "results" / "interleave.png"),
                    help="timeline of the first rate and size ('' for none)")
    args = ap.parse_args()
    if args.backward_ms is None:
        args.backward_ms = 2 * args.compute_ms  # backward does about twice forward's work
    why = unavailable()
    if why:
        print(f"cannot run: {why}", file=sys.stderr)
        return 2
    # SIGTERM ends the run like Ctrl-C: the finally blocks remove the namespaces.
    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
    modes = [m for m in args.modes.split(",") if m]
    rates = [r for r in args.rate.split(",") if r]
    sizes = [int(x) for x in args.ckpt_mb.split(",") if x]
    skip = min(args.warmup + 2, args.steps // 2)
    net = Net(2)
    runs, rows, first_reports = [], [], None
    header = ("| link | checkpoint | no checkpoint | " + " | ".join(LABELS[m] for m in MODES[1:]) + " |\n"
              "| --- | --- | --- | " + " | ".join("---" for _ in MODES[1:]) + " |")
    try:
        for rate in rates:
            shape(net, rate, not args.no_slow_start_after_idle)
            raw = raw_throughput(net, max(8 << 20, args.grad_mb << 21))
            print(f"{rate}: raw TCP over the shaped link {raw / 1e6:.1f} MB/s; the all-reduce of {args.grad_mb} MiB "
                  f"moves about {args.grad_mb * 2**20 / raw * 1e3:.0f} ms of link time per step", flush=True)
            nockpt = None
            for ckpt_mb in sizes:
                results, reports = measure(net, rate, ckpt_mb, modes, args, skip, nockpt)
                nockpt = results.get("nockpt")
                if first_reports is None:
                    first_reports = (reports, f"{rate}, {ckpt_mb} MiB checkpoint every step")
                if nockpt and ckpt_mb == sizes[0]:
                    print(f"{rate}: step without checkpoints: {geometry(nockpt['profile'])}", flush=True)
                rows.append(row(rate, ckpt_mb, results))
                print(f"{header}\n{rows[-1]}", flush=True)
                runs.append({"rate": rate, "raw_tcp_bytes_per_s": raw, "ckpt_mb": ckpt_mb, "results": results,
                             "geometry": geometry(nockpt["profile"]) if nockpt else None})
    finally:
        net.close()
    table = header + "\n" + "\n".join(rows)
    print(f"\n{args.pattern}: {args.grad_mb} MiB all-reduce in {args.buckets} buckets, forward {args.compute_ms:.0f} ms, backward "
          f"{args.backward_ms:.0f} ms, {args.steps} steps (first {skip} not counted); step median (p95) ms, vs no "
          f"checkpoint, share of chunk time overlapping training communication\n{table}")
    out = {"command": "python " + " ".join(sys.argv), "pattern": args.pattern, "grad_mb": args.grad_mb,
           "buckets": args.buckets,
           "compute_ms": args.compute_ms, "backward_ms": args.backward_ms, "spin": args.spin, "steps": args.steps,
           "skipped_steps": skip, "runs": runs, "table_markdown": table}
    write_results(args.out, out)
    if args.png and first_reports is not None:
        try:
            plot(first_reports[0], args.png, iterations=3, title=first_reports[1])
        except ImportError:
            print("matplotlib is missing: pip install -r requirements-bench.txt for the timeline", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
