"""bench/goodput.py's results as tables (markdown) and a plot (PNG): the measured failures,
the step times, the goals of issue 32, and the model's ETTR for 16 to 16,384 GPUs."""

from __future__ import annotations

import statistics
from pathlib import Path

import goodput_model as gm

LABELS = {"tiercel": "tiercel (RAM + peer + bucket, every iteration)", "persist": "persist to the bucket only (Young/Daly)",
          "dcp": "torch DCP to a shared directory (Young/Daly)"}


#: The model's row for tiercel's host-loss costs at Young/Daly's interval (modelled, not run).
INTERVAL = "tiercel/host at Young/Daly's interval"


def step_times(run: dict, warmup: int, skip: int) -> dict:
    """Median step times of a method: without checkpoints (the first launch's warmup, less
    its first 2 iterations), with them (every launch past its first `skip` iterations), and
    the median blocking time of its checkpoints."""
    first = run["launches"][0]
    plain = [e["step_s"] for e in first if 2 < e["it"] <= warmup]
    steady, saves = [], []
    for its in run["launches"]:
        if not its:
            continue
        begin = its[0]["it"]
        steady += [e["step_s"] for e in its if e["it"] > warmup and e["it"] >= begin + skip]
        saves += [e["save_s"] for e in its if e["save_s"] is not None]
    med = lambda xs: statistics.median(xs) if xs else None  # noqa: E731
    return {"no_checkpoint_s": med(plain), "with_checkpoints_s": med(steady), "save_s": med(saves),
            "steady_iterations": len(steady), "saves": len(saves)}


def model_costs(result: dict) -> dict[str, gm.Costs]:
    """The model's inputs, from the measurements: per method (and tiercel per failure kind)."""
    out: dict[str, gm.Costs] = {}
    for method, run in result["runs"].items():
        st = run["steps"]
        it = st["no_checkpoint_s"] or run["plan"]["step_s"]
        for rec in run["failures"]:
            restart = rec["stop_s"] + rec["restart_s"]
            if method == "tiercel":
                overhead = max(0.0, (st["with_checkpoints_s"] or it) - it)
                out[f"tiercel/{rec['kind']}"] = gm.Costs(it, overhead, restart, rec["restore_s"], True, rec["iterations_lost"])
                if rec["kind"] == "host":
                    # Modelled, not run: the same costs with a checkpoint at Young/Daly's
                    # interval for them, as the baselines get (the step time a checkpoint
                    # adds, here on a CPU that trains too, is then paid once per interval).
                    out[INTERVAL] = gm.Costs(it, overhead, restart, rec["restore_s"])
            elif method not in out:
                out[method] = gm.Costs(it, st["save_s"] or run["plan"]["first_save_s"], restart, rec["restore_s"])
    return out


def beyond_restart(rec: dict) -> float:
    """What a failure wasted beyond stopping and restarting the processes: the restore, and
    the training redone or interrupted."""
    return rec["wasted_s"] - rec["stop_s"] - rec["restart_s"]


def goals(result: dict) -> list[str]:
    """Issue 32's goals against what was measured."""
    runs = result["runs"]
    lines: list[str] = []
    t = runs.get("tiercel")
    if not t:
        return lines
    by_kind = {r["kind"]: r for r in t["failures"]}
    step = t["steps"]["with_checkpoints_s"] or t["plan"]["step_s"]
    host = by_kind.get("host")
    if host:
        beyond = host["wasted_s"] - host["stop_s"] - host["restart_s"] - host["restore_s"]
        lines.append(f"host loss: {host['wasted_s']:.2f} s wasted = restart {host['stop_s'] + host['restart_s']:.2f} s + restore "
                     f"{host['restore_s']:.2f} s + {beyond:.2f} s ({beyond / step:.2f} iterations of {step * 1e3:.0f} ms) of "
                     f"training redone or interrupted (goal: <= 1.5 iterations plus the restart: "
                     f"{'met' if beyond / step <= 1.5 else 'not met'})")
        for base in ("persist", "dcp"):
            if base in runs and runs[base]["failures"]:
                b = runs[base]["failures"][0]
                ratio, inner = b["wasted_s"] / host["wasted_s"], beyond_restart(b) / max(1e-9, beyond_restart(host))
                goal = f" (goal >= 13x: {'met' if ratio >= 13 else 'not met'})" if base == "persist" else ""
                lines.append(f"host loss against {base}: {b['wasted_s']:.2f} s against {host['wasted_s']:.2f} s wasted, "
                             f"{ratio:.1f}x less{goal}; beyond the restart (the process launch, the same for every "
                             f"method), {beyond_restart(b):.2f} s against "
                             f"{beyond_restart(host):.2f} s, {inner:.1f}x less")
    pre = by_kind.get("preempt")
    if pre:
        lines.append(f"preemption with {result['params']['grace']:.0f} s notice: {pre['iterations_lost']} completed "
                     f"iteration(s) lost (goal 0: {'met' if pre['iterations_lost'] == 0 else 'not met'})")
    return lines


def markdown(result: dict, costs: dict[str, gm.Costs], curves: dict[str, dict[int, float]]) -> str:
    p, sb, links = result["params"], result["state_bytes"], result["links"]
    head = (f"{'Quick mode (tiny model, few iterations): not the full run. ' if result['quick'] else ''}"
            f"{p['hosts']} hosts (network namespaces), one rank each; MLP {p['width']} x {p['depth']} "
            f"({sb['model'] / 2**20:.1f} MiB of parameters, {sb['checkpoint'] / 2**20:.1f} MiB per checkpoint with Adam's "
            f"moments), batch {p['batch']}, {p['compute_ms']:.0f} ms of accelerator time per step; links: host to host "
            f"{p['peer_rate']} (raw TCP {links['host_to_host_bytes_per_s'] / 1e6:.1f} MB/s), object store {p['store_rate']} "
            f"(raw TCP {links['host_to_store_bytes_per_s'] / 1e6:.1f} MB/s). Baselines' interval: Young/Daly for their "
            f"first checkpoint's cost at an MTBF of {result['mtbf_s'] / 3600:.2f} h.")
    rows = ["| method | failure | after iteration | restored step (from) | iterations lost | stop s | restart s | restore s "
            "| wasted s | of it beyond the restart s |",
            "| --- | --- | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for method, run in result["runs"].items():
        for r in run["failures"]:
            rows.append(f"| {method} | {r['kind']} | {r['failed_after']} | {r['restored_step']} ({'/'.join(r['restored_from']) or '-'}) "
                        f"| {r['iterations_lost']} | {r['stop_s']:.2f} | {r['restart_s']:.2f} | {r['restore_s']:.2f} | {r['wasted_s']:.2f} "
                        f"| {beyond_restart(r):.2f} |")
    behind = [f"- tiercel, {r['kind']}, rank {rank}'s next-to-last step, one step after its save: "
              + ", ".join(f"{t} {st}" for t, st in states.items())
              for r in result["runs"].get("tiercel", {}).get("failures", [])
              for rank, states in sorted((r.get("tiers_at_failure") or {}).items())]
    for stats in result["runs"].get("tiercel", {}).get("traffic", [])[:1]:
        for name, link in stats["links"].items():
            if link.get("network") and link.get("plan"):
                behind.append(f"- tiercel's learned schedule, link '{name}': bandwidth estimated at "
                              f"{(link['bandwidth'] or 0) / 1e6:.1f} MB/s, a checkpoint every "
                              f"{link['plan']['effective_interval']} iteration(s)"
                              + (f" ({link['plan']['note']})" if link["plan"].get("note") else ""))
    steps = ["| method | checkpoint every | step without checkpoints ms | step with them ms | checkpoint blocks ms |",
             "| --- | ---: | ---: | ---: | ---: |"]
    for method, run in result["runs"].items():
        st = run["steps"]
        f = lambda x: f"{x * 1e3:.0f}" if x is not None else "-"  # noqa: E731
        steps.append(f"| {method} | {run['plan']['k']} | {f(st['no_checkpoint_s'])} | {f(st['with_checkpoints_s'])} | {f(st['save_s'])} |")
    ns = sorted(next(iter(curves.values()))) if curves else []
    ettr = ["| method | " + " | ".join(f"{n} GPUs" for n in ns) + " |", "| --- |" + " ---: |" * len(ns)]
    ettr.append("| MTBF (h) | " + " | ".join(f"{gm.mtbf_of(n) / 3600:.2f}" for n in ns) + " |")
    for name, c in curves.items():
        ettr.append(f"| {name} | " + " | ".join(f"{c[n]:.3f}" for n in ns) + " |")
    waste = [f"- {name}: {c.waste_per_failure(gm.mtbf_of(1024)):.1f} s per failure at 1,024 GPUs" for name, c in costs.items()]
    return "\n".join([
        "# Goodput (bench/goodput.py)", "", head, "", "## Failures", "", *rows, "", *behind, "", "## Step times", "", *steps, "",
        "## Goals (issue 32)", "", *[f"- {g}" for g in goals(result)], "",
        "## ETTR by job size (bench/goodput_model.py, from the costs above)", "", *ettr, "",
        "Expected waste per failure, the model's inputs:", "", *waste, "",
        f"Published, for comparison: GEMINI recovered with {gm.GEMINI_WASTE_RATIO:.0f}x less wasted time than from remote "
        f"storage; ByteRobust reached an ETTR of {gm.BYTEROBUST_ETTR[1]:.2f} on {gm.BYTEROBUST_ETTR[0]:,} GPUs over three months.",
        "", f"Command: `{result['command']}`", ""])


def plot(result: dict, curves: dict[str, dict[int, float]], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 4.8))
    bars = [(f"{m}\n{r['kind']}", r) for m, run in result["runs"].items() for r in run["failures"]]
    bottom = [0.0] * len(bars)
    parts = [("stop", lambda r: r["stop_s"]), ("restart", lambda r: r["restart_s"]), ("restore", lambda r: r["restore_s"]),
             ("training redone", lambda r: max(0.0, r["wasted_s"] - r["stop_s"] - r["restart_s"] - r["restore_s"]))]
    for name, get in parts:
        vals = [get(r) for _, r in bars]
        ax1.bar(range(len(bars)), vals, bottom=bottom, label=name)
        bottom = [b + v for b, v in zip(bottom, vals)]
    ax1.set_xticks(range(len(bars)), [b for b, _ in bars], fontsize=8)
    ax1.set_ylabel("seconds wasted per failure (measured)")
    ax1.set_title("Measured: one failure each" + (" (quick mode)" if result["quick"] else ""), fontsize=10)
    ax1.legend(fontsize=8)
    for name, c in curves.items():
        ns = sorted(c)
        ax2.plot(ns, [c[n] for n in ns], "o-", label=name, ms=3)
    ax2.plot([gm.BYTEROBUST_ETTR[0]], [gm.BYTEROBUST_ETTR[1]], "k*", ms=10, label="ByteRobust, published (9,600 GPUs)")
    ax2.set_xscale("log", base=2)
    ax2.set_xlabel("GPUs (MTBF: Meta's 1,024 / 16,384-GPU figures, power law between)")
    ax2.set_ylabel("ETTR (model)")
    ax2.set_title("Effective training time ratio from the measured costs", fontsize=10)
    ax2.legend(fontsize=7)
    ax2.grid(alpha=0.3)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


def report(result: dict, out: str) -> None:
    """Adds the step times and the model to `result`; writes out.md and out.png."""
    skip = result["params"]["warmup"] // 2 + 3  # after a (re)start: the traffic profile's warmup and cold caches
    for run in result["runs"].values():
        run["steps"] = step_times(run, run["plan"]["warmup"], skip)
    costs = model_costs(result)
    curves = gm.curves(costs)
    result["model"] = {"gpus": gm.GPU_COUNTS, "mtbf_s": {n: gm.mtbf_of(n) for n in gm.GPU_COUNTS},
                       "costs": {k: vars(c) for k, c in costs.items()}, "ettr": curves,
                       "waste_per_failure_1024_s": {k: c.waste_per_failure(gm.mtbf_of(1024)) for k, c in costs.items()}}
    md = markdown(result, costs, curves)
    Path(out + ".md").parent.mkdir(parents=True, exist_ok=True)
    Path(out + ".md").write_text(md)
    print("\n" + md)
    try:
        plot(result, curves, out + ".png")
    except ImportError:
        print("matplotlib is missing: pip install -r requirements-bench.txt for the plot")
