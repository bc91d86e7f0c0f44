"""Does checkpoint traffic slow training? Step time of a 2-host DDP job (gloo) over shaped
links, with a peer tier replicating a checkpoint every step, for: no checkpointing; the
traffic scheduler off (naive); mode "signals"; mode "learned".

Hosts are Linux network namespaces on one bridge (tests/netns.py), each host's link shaped
with `tc tbf` to `--rate`. Each step: `--compute-ms` of forward compute (the network is idle),
then backward with DDP's all-reduce of `--grad-mb`, then `store.save` of `--ckpt-mb` (copied to
shared memory; the peer tier replicates it to the other host in the background).
In the same run: the raw TCP throughput of the shaped link (the physical limit).

    sudo /root/.cache/tiercel/venv/bin/python bench/interleave.py --steps 60 --rate 1gbit
    sudo ... bench/interleave.py --steps 10 --grad-mb 2 --ckpt-mb 8 --rate 200mbit   # small

Writes bench/results/interleave.json and a timeline PNG (--png) of a few iterations per mode:
when training communication and checkpoint chunks used the link. Needs root (namespaces, tc)
and matplotlib (requirements-bench.txt). Every namespace is removed at the end, also on
failure or Ctrl-C.
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

MODES = ["nockpt", "off", "signals", "learned"]
LABELS = {"nockpt": "no checkpoint", "off": "scheduler off (naive)", "signals": "signals", "learned": "learned"}
PYTHON = sys.executable


def shape(net: Net, rate: str) -> None:
    """Every host's egress to `rate` (tc tbf): a host sends no faster than its link."""
    for i in range(net.n):
        subprocess.run([*net.exec_prefix(i), "tc", "qdisc", "add", "dev", "eth0", "root", "tbf", "rate", rate,
                        "burst", "256kb", "latency", "100ms"], check=True, capture_output=True)


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


def run_mode(net: Net, mode: str, args: argparse.Namespace, out: Path, shm: str) -> list[dict]:
    cfg = {"mode": mode, "steps": args.steps, "grad_mb": args.grad_mb, "ckpt_mb": args.ckpt_mb,
           "compute_s": args.compute_ms / 1e3, "chunk": args.chunk, "warmup": args.warmup, "shm": shm,
           "addrs": [net.addr(i) for i in range(net.n)], "out": str(out)}
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


def plot(reports: dict[str, list[dict]], path: str, iterations: int) -> None:
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
    axes[0, 0].legend(loc="upper right", fontsize=7)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--rate", default="1gbit", help="tc rate of every host's link (e.g. 1gbit, 200mbit)")
    ap.add_argument("--grad-mb", type=int, default=20, help="MiB all-reduced per step")
    ap.add_argument("--ckpt-mb", type=int, default=100, help="MiB saved (and replicated) per step")
    ap.add_argument("--compute-ms", type=float, default=100.0, help="forward compute per step (idle network)")
    ap.add_argument("--chunk", default="1MiB", help="[store] chunk_size")
    ap.add_argument("--warmup", type=int, default=10, help="[traffic] warmup iterations")
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--timeout", type=float, default=1800)
    ap.add_argument("--out", default=str(HERE / "results" / "interleave.json"))
    ap.add_argument("--png", default=str(HERE / "results" / "interleave.png"))
    args = ap.parse_args()
    why = unavailable()
    if why:
        print(f"cannot run: {why}", file=sys.stderr)
        return 2
    # SIGTERM ends the run like Ctrl-C: the finally blocks remove the namespaces.
    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
    modes = [m for m in args.modes.split(",") if m]
    skip = min(args.warmup + 2, args.steps // 2)
    net = Net(2)
    try:
        shape(net, args.rate)
        raw = raw_throughput(net, max(8 << 20, args.grad_mb << 21))
        print(f"raw TCP over the shaped link: {raw / 1e6:.1f} MB/s; the all-reduce of {args.grad_mb} MiB moves "
              f"about {args.grad_mb * 2**20 / raw * 1e3:.0f} ms of link time per step")
        reports: dict[str, list[dict]] = {}
        with tempfile.TemporaryDirectory(prefix="tiercel-interleave-") as tmp, \
                tempfile.TemporaryDirectory(prefix="tiercel-interleave-", dir="/dev/shm") as shm:
            for mode in modes:
                reports[mode] = run_mode(net, mode, args, Path(tmp), shm)
    finally:
        net.close()
    results = {}
    for mode, reps in reports.items():
        # The job's step time: the slower rank's.
        per_rank = [summary(r["times"], skip) for r in reps]
        s = max(per_rank, key=lambda x: x["median_s"])
        peer = reps[0].get("peer") or {}
        stats = reps[0]["stats"]
        results[mode] = {**s, "waits": stats["waits"], "wait_seconds": stats["wait_seconds"],
                         "replicated_steps": peer.get("steps_written"), "skips": peer.get("skips"),
                         "plan": stats["links"]["peer"]["plan"], "profile": stats["profile"]}
    base = results.get("nockpt", {}).get("median_s")
    rows = []
    for mode, r in results.items():
        rel = f"{r['median_s'] / base:.2f}x" if base else "-"
        plan = r["plan"] or {}
        rows.append(f"| {LABELS[mode]} | {r['median_s'] * 1e3:.0f} | {r['p95_s'] * 1e3:.0f} | {rel} | "
                    f"{r['replicated_steps'] if mode != 'nockpt' else '-'} | {plan.get('effective_interval', '-')} |")
    table = ("| schedule | step median (ms) | p95 (ms) | vs no checkpoint | steps replicated | effective interval |\n"
             "| --- | --- | --- | --- | --- | --- |\n" + "\n".join(rows))
    print(f"\n{args.rate}, {args.grad_mb} MiB all-reduce, {args.ckpt_mb} MiB checkpoint every step, "
          f"{args.steps} steps (first {skip} not counted)\n{table}")
    out = {"command": "python " + " ".join(sys.argv), "rate": args.rate, "raw_tcp_bytes_per_s": raw,
           "grad_mb": args.grad_mb, "ckpt_mb": args.ckpt_mb, "compute_ms": args.compute_ms, "steps": args.steps,
           "skipped_steps": skip, "results": results, "table_markdown": table}
    write_results(args.out, out)
    try:
        plot(reports, args.png, iterations=3)
    except ImportError:
        print("matplotlib is missing: pip install -r requirements-bench.txt for the timeline", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
