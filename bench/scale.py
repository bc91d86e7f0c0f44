"""tiercel at 8 ... 10,000 ranks, simulated (docs/scale.md, "Simulated scale").

Two simulators that run tiercel's own code, not a model of it:

- Saves: `examples/scale_sim.rs` (tiercel_core::testing::sim): N rank threads each persist
  a step to one object-store tier through tiercel's BlobTier, StepLayout and gc (write,
  commit, retention), against an in-process object store with S3's request latency and
  per-prefix rates (503 SlowDown above them, retried as the client does). Per step: the
  requests by kind and per rank, the busiest prefix's demand in its busiest second, 503s,
  and the time from the last rank's manifest to the commit record.
- Restore agreement: `_agree_sim.py`: N rank threads run `tiercel.newest.agree` with
  `KVStoreCoordinator` over an in-process key-value store that charges each call a round
  trip and queues calls on one server (a TCPStore).

Writes bench/results/scale.json, scale.md (the table) and scale.png (against N).

    python bench/scale.py              # N = 8, 32, 128, 512, 2048, 10000
    python bench/scale.py --quick      # N = 8: a smoke test, seconds
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "python"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import _agree_sim  # noqa: E402
from _measure import write_results  # noqa: E402

RANKS = [8, 32, 128, 512, 2048, 10000]
#: Today's protocol reads every manifest on every rank that sees them all: about N² GETs a
#: step, 4 million at N = 2,048 (13 minutes at S3's 5,500 a second per prefix), 10^8 at
#: N = 10,000 (5 hours). Above this N it is not run.
LIST_MAX = 512
S3_WRITES, S3_READS = 3500, 5500


def build() -> Path:
    """Builds the simulator; its path."""
    target = Path(os.environ.get("CARGO_TARGET_DIR", Path.home() / ".cache/tiercel/target"))
    cmd = ["cargo", "build", "--release", "--quiet", "-p", "tiercel-core", "--features", "testing", "--example", "scale_sim"]
    print("==>", " ".join(cmd), flush=True)
    subprocess.run(cmd, cwd=ROOT, check=True, env={**os.environ, "CARGO_TARGET_DIR": str(target)})
    return target / "release/examples/scale_sim"


def simulate_saves(binary: Path, n: int, protocol: str, args: argparse.Namespace) -> dict:
    """One run of the save simulator at N = n: its last step (the steady state: it removes
    the step before, keep = 1)."""
    cmd = [str(binary), "--ranks", str(n), "--steps", str(args.steps), "--keep", "1", "--protocol", protocol,
           "--latency-ms", str(args.latency_ms), "--time-limit-s", str(args.time_limit_s),
           "--kv-latency-ms", str(args.kv_latency_ms), "--kv-service-us", str(args.kv_service_us)]
    # The host's load (other work on a shared machine) stretches the times, never the counts.
    load = os.getloadavg()[0]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    run = json.loads(out.splitlines()[-1])
    # The first step is of fresh processes (each rank's uncommit cannot know there is
    # nothing to take back): its hot spot is reported beside the steady state.
    first = run["steps"][0]
    first = {k: first[k] for k in ("requests", "slowdowns", "busiest_prefix_writes", "peak_prefix_writes_at",
                                    "failed_ranks", "commit_delay_s")}
    return {**run["steps"][-1], "ranks": n, "protocol": protocol, "first": first, "load": [load, os.getloadavg()[0]]}


def row(s: dict, agree: _agree_sim.AgreeResult | None) -> str:
    k = s["by_kind"]
    delay = "—" if s["commit_delay_s"] is None else f"{s['commit_delay_s']:.2f}"
    note = " (stopped)" if s["stopped"] else (f" ({s['failed_ranks']} ranks failed)" if s["failed_ranks"] else "")
    ag = "" if agree is None else f"{agree.estimate_s:.2f} ({agree.seconds:.2f}) | {agree.ops_per_rank:.2f}"
    return (f"| {s['ranks']:,} | {s['protocol']} | {s['per_rank']:.1f}{note} | {k['GET']:,} | {k['LIST']:,} | {k['HEAD']:,} | "
            f"{k['PUT']:,} | {k['DELETE'] + k['POST']:,} | {s['prefixes_written']:,} | {s['busiest_prefix_writes']:,} | "
            f"{s['peak_prefix_writes_per_s']:,} / {s['peak_prefix_reads_per_s']:,} | "
            f"{s['slowdowns']:,} | {delay} | {first(s)} | {ag} |")


def first(s: dict) -> str:
    """The first step's (fresh processes) busiest prefix and 503s."""
    f = s.get("first")
    if f is None:
        return "—"
    note = f", {f['failed_ranks']:,} ranks failed" if f["failed_ranks"] else ""
    return f"{f['busiest_prefix_writes']:,} / {f['slowdowns']:,}{note}"


def table(saves: list[dict], agrees: dict[int, _agree_sim.AgreeResult], args: argparse.Namespace) -> str:
    loads = [x for s in saves for x in s.get("load", [])]
    load = f" Load average of this host ({os.cpu_count()} cores) over the runs: {min(loads):.1f}-{max(loads):.1f}." if loads else ""
    head = (f"Object store: {args.latency_ms:g} ms a request, {S3_WRITES:,} writes and {S3_READS:,} reads a second per prefix; "
            f"coordinator: {args.kv_latency_ms:g} ms a call, {args.kv_service_us:g} µs of its server each.{load}\n\n"
            "| ranks | commit | requests per rank | GET | LIST | HEAD | PUT | DELETE (+ multi) | prefixes written | "
            "writes on the busiest prefix | busiest prefix in its busiest second, writes / reads | "
            "503s | commit after last data (s) | first step: writes on the busiest prefix / 503s | "
            "restore agreement (s): critical path (simulated here) | agreement: coordinator calls per rank |\n"
            "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n")
    return head + "\n".join(row(s, agrees.get(s["ranks"])) for s in saves) + "\n"


def plot(saves: list[dict], agrees: dict[int, _agree_sim.AgreeResult], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(2, 2, figsize=(11, 8))
    for protocol in sorted({s["protocol"] for s in saves}):
        runs = [s for s in saves if s["protocol"] == protocol]
        n = [s["ranks"] for s in runs]
        ax[0][0].plot(n, [s["per_rank"] for s in runs], "o-", label=protocol)
        for s in runs:
            if s["failed_ranks"]:
                ax[0][0].annotate(f"{s['failed_ranks']:,} ranks failed\n(503s past the retries)", (s["ranks"], s["per_rank"]),
                                  textcoords="offset points", xytext=(-110, 8), fontsize=7)
        for key, style, what in (("peak_prefix_writes_per_s", "o-", "writes"), ("peak_prefix_reads_per_s", "s--", "reads")):
            seen = [s for s in runs if s[key] > 0]  # a log scale: a run without any is left out
            ax[0][1].plot([s["ranks"] for s in seen], [s[key] for s in seen], style, label=f"{protocol}: {what}")
        done = [s for s in runs if s["commit_delay_s"] is not None]
        ax[1][0].plot([s["ranks"] for s in done], [s["commit_delay_s"] for s in done], "o-", label=protocol)
    ax[0][1].axhline(S3_WRITES, color="grey", lw=0.8, ls=":", label="S3 writes / prefix")
    ax[0][1].axhline(S3_READS, color="black", lw=0.8, ls=":", label="S3 reads / prefix")
    ax[1][0].axhline(2.0, color="grey", lw=0.8, ls=":", label="goal: 2 s")
    ns = sorted(agrees)
    ax[1][1].plot(ns, [agrees[k].estimate_s for k in ns], "o-", label="critical path")
    ax[1][1].plot(ns, [agrees[k].seconds for k in ns], "s--", label="simulated here (N threads on this host's cores)")
    ax[1][1].axhline(1.0, color="grey", lw=0.8, ls=":", label="goal: 1 s")
    titles = ["requests per rank per step", "busiest prefix, requests in its busiest second",
              "commit record after the last rank's data (s)", "restore agreement (s)"]
    for a, t in zip([x for r in ax for x in r], titles):
        a.set_xscale("log")
        a.set_yscale("log")
        a.set_xlabel("ranks")
        a.set_title(t, fontsize=10)
        a.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


def redraw(out: Path) -> int:
    """The table and the plot again, from a run's results."""
    data = json.loads(Path(f"{out}.json").read_text())
    agrees = {int(n): SimpleNamespace(**a) for n, a in data["agreement"].items()}
    Path(f"{out}.md").write_text(table(data["saves"], agrees, argparse.Namespace(**data["args"])))  # type: ignore[arg-type]
    plot(data["saves"], agrees, Path(f"{out}.png"))  # type: ignore[arg-type]
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="N = 8 only (a smoke test)")
    ap.add_argument("--ranks", default=None, help="comma-separated N (default 8,32,128,512,2048,10000)")
    ap.add_argument("--protocols", default="list-all,counter",
                    help="commit protocols, comma-separated: list-all (before issue 34: every rank lists, reads "
                         "and retains), list (no coordinator: rank 0 retains), counter")
    ap.add_argument("--steps", type=int, default=3,
                    help="steps per run; the last is reported (the steady state from the third: each rank's sweep "
                         "removes its objects of the step before), the first beside it")
    ap.add_argument("--list-max", type=int, default=LIST_MAX, help="the largest N the list protocols run at")
    ap.add_argument("--add", action="store_true",
                    help="add these runs to the results prefix's .json (replacing runs of the same N), then redraw")
    ap.add_argument("--latency-ms", type=float, default=20.0, help="object store round trip")
    ap.add_argument("--kv-latency-ms", type=float, default=1.0, help="coordinator round trip")
    ap.add_argument("--kv-service-us", type=float, default=10.0, help="coordinator server time per call")
    ap.add_argument("--time-limit-s", type=float, default=300.0, help="a step still running after this is stopped")
    ap.add_argument("--out", default=str(ROOT / "bench/results/scale"), help="results prefix (.json, .md, .png)")
    ap.add_argument("--plot-only", action="store_true", help="redraw the table and plot from the results prefix's .json")
    args = ap.parse_args()
    if args.plot_only:
        return redraw(Path(args.out))
    ranks = [8] if args.quick else [int(n) for n in args.ranks.split(",")] if args.ranks else RANKS
    binary = build()
    saves, agrees = [], {}
    for n in ranks:
        for protocol in args.protocols.split(","):
            if protocol.startswith("list") and n > args.list_max:
                print(f"N = {n:,} {protocol}: not run (about N² = {n * n:,} manifest reads a step)", flush=True)
                continue
            t0 = time.time()
            s = simulate_saves(binary, n, protocol, args)
            saves.append(s)
            print(f"N = {n:,} {protocol}: {s['per_rank']:.1f} requests per rank, {s['slowdowns']:,} 503s, commit "
                  f"{s['commit_delay_s']} s after the last data ({time.time() - t0:.0f} s)", flush=True)
        t0 = time.time()
        agrees[n] = a = _agree_sim.run(n, args.kv_latency_ms / 1000, args.kv_service_us / 1e6)
        if a.errors or len(a.steps) != 1:
            print(f"N = {n:,} agreement FAILED: {a.errors or a.steps}", flush=True)
            return 1
        print(f"N = {n:,} restore agreement: {a.estimate_s:.3f} s on the critical path ({a.combine_cpu_s:.3f} s combining), "
              f"{a.seconds:.2f} s simulated here (cpu {a.cpu_s:.1f} s), {a.ops_per_rank:.2f} store calls per rank "
              f"({time.time() - t0:.0f} s)", flush=True)
    out = Path(args.out)
    if args.add and Path(f"{out}.json").exists():
        old = json.loads(Path(f"{out}.json").read_text())
        saves = [s for s in old["saves"] if s["ranks"] not in agrees] + saves
        saves.sort(key=lambda s: (s["ranks"], s["protocol"] != "list-all", s["protocol"]))
        agrees = {**{int(k): SimpleNamespace(**a) for k, a in old["agreement"].items() if int(k) not in agrees}, **agrees}
    md = table(saves, agrees, args)
    print("\n" + md)
    write_results(f"{out}.json", {
        "args": {**vars(args), "out": os.path.relpath(args.out, ROOT)}, "saves": saves,
        "agreement": {n: {"seconds": a.seconds, "estimate_s": a.estimate_s, "combine_cpu_s": a.combine_cpu_s, "ops": a.ops,
                          "ops_per_rank": a.ops_per_rank, "ops_by_kind": a.ops_by_kind, "cpu_s": a.cpu_s}
                      for n, a in agrees.items()},
    })
    Path(f"{out}.md").write_text(md)
    plot(saves, agrees, Path(f"{out}.png"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
