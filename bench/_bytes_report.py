"""bench/bytes.py's tables, goals and plot, from its results dict."""

from __future__ import annotations

import statistics
from typing import Any

MiB = 1 << 20


def _later(c: dict[str, Any]) -> list[dict[str, Any]]:
    """The steps after the first: the first stores everything either way."""
    return c["steps"][1:] or c["steps"]


def summary(c: dict[str, Any]) -> dict[str, Any]:
    later = _later(c)
    out = {
        "state_mib": c["steps"][-1]["state_bytes"] / MiB,
        "mib_per_step": statistics.mean(r["bytes_written"] for r in later) / MiB,
        "mib_total": sum(r["bytes_written"] for r in c["steps"]) / MiB,
        "persist_s": statistics.median(r["persist_s"] for r in later),
        "save_s": statistics.median(r["save_s"] for r in later),
        "restore_newest_s": c["restore"]["newest"]["seconds"],
        "restore_old_s": c["restore"]["old"]["seconds"],
    }
    if "requests" in c["steps"][0]:
        out["requests_per_step"] = statistics.mean(sum(r["requests"].values()) for r in later)
        out["requests_by_kind"] = {k: statistics.mean(r["requests"][k] for r in later) for k in later[0]["requests"]}
    return out


def pairs(res: dict[str, Any]) -> list[tuple[str, str, dict[str, Any], dict[str, Any]]]:
    """(workload, server, summary without dedup, summary with dedup) for each pair measured."""
    by: dict[tuple[str, str], dict[bool, dict[str, Any]]] = {}
    for c in res["configs"]:
        by.setdefault((c["workload"], c["server"]), {})[c["dedup"]] = summary(c)
    return [(w, s, d[False], d[True]) for (w, s), d in by.items() if False in d and True in d]


def GOALS(res: dict[str, Any]) -> list[tuple[str, str, bool | None]]:
    """(goal, what was measured, met) for each goal of the issue that the run measured."""
    out: list[tuple[str, str, bool | None]] = []
    for w, server, off, on in pairs(res):
        fewer = off["mib_per_step"] / max(on["mib_per_step"], 1e-9)
        whole = off["mib_total"] / max(on["mib_total"], 1e-9)
        faster = off["persist_s"] / max(on["persist_s"], 1e-9)
        where = f"{w}, {server}"
        if w == "lora":
            out.append((f"{where}: >= 8x fewer bytes", f"{fewer:.1f}x a step after the first, {whole:.1f}x over the run", fewer >= 8))
            out.append((f"{where}: >= 5x faster persist", f"{faster:.1f}x", faster >= 5))
        elif w == "moe":
            out.append((f"{where}: >= 2.5x fewer bytes", f"{fewer:.2f}x a step after the first, {whole:.2f}x over the run",
                        fewer >= 2.5))
        elif w == "dense":
            slower = on["persist_s"] / max(off["persist_s"], 1e-9)
            out.append((f"{where}: persist within 5% of dedup off", f"{slower:.3f}x (save {on['save_s'] / max(off['save_s'], 1e-9):.3f}x)",
                        slower <= 1.05))
    for w, lim in res["limits"].items():
        out.append((f"{w}: hashing >= 5 GB/s per core", f"{lim['hash_gb_s']:.2f} GB/s", lim["hash_gb_s"] >= 5))
    return out


def _pair(a: float, b: float, fmt: str = "{:.2f}") -> str:
    return f"{fmt.format(a)} / {fmt.format(b)}"


def markdown(res: dict[str, Any]) -> str:
    head = ("| workload | tier (server) | MiB a step | written MiB/step: off / on | fewer | over the run | "
            "requests/step: off / on | persist s/step: off / on | faster | save s: off / on | "
            "restore newest s: off / on | restore step 1 s: off / on |")
    lines = [f"{res['steps']} steps a configuration; means (bytes, requests) and medians (seconds) over the steps "
             "after the first; off / on: `dedup = false` / `true`.", "", head, "| --- | --- |" + " ---: |" * 10]
    for w, server, off, on in pairs(res):
        reqs = _pair(off["requests_per_step"], on["requests_per_step"], "{:.1f}") if "requests_per_step" in on else ""
        lines.append("| " + " | ".join([
            w, server, f"{on['state_mib']:.1f}", _pair(off["mib_per_step"], on["mib_per_step"], "{:.1f}"),
            f"{off['mib_per_step'] / max(on['mib_per_step'], 1e-9):.1f}x", f"{off['mib_total'] / max(on['mib_total'], 1e-9):.1f}x",
            reqs, _pair(off["persist_s"], on["persist_s"], "{:.3f}"), f"{off['persist_s'] / max(on['persist_s'], 1e-9):.2f}x",
            _pair(off["save_s"], on["save_s"], "{:.3f}"), _pair(off["restore_newest_s"], on["restore_newest_s"]),
            _pair(off["restore_old_s"], on["restore_old_s"]),
        ]) + " |")
    servers = sorted({k.removeprefix("boto3_put_s_") for lim in res["limits"].values() for k in lim if k.startswith("boto3_put_s_")})
    lines += ["", "The same step's bytes without tiercel (seconds, median), and the hashing a save does per chunk:", "",
              "| workload | MiB a step | disk write + fsync | torch.save + fsync | "
              + "".join(f"boto3 put_object ({s}) | " for s in servers) + "CRC32C + XXH3-128, one core | memcpy, one core |",
              "| --- |" + " ---: |" * (5 + len(servers))]
    for w, lim in res["limits"].items():
        cells = [w, f"{lim['state_bytes'] / MiB:.1f}", f"{lim.get('disk_write_fsync_s', float('nan')):.3f}",
                 f"{lim.get('torch_save_fsync_s', float('nan')):.3f}"]
        cells += [f"{lim[f'boto3_put_s_{s}']:.3f}" for s in servers] + [f"{lim['hash_gb_s']:.2f} GB/s"]
        cells += [f"{lim['memcpy_gb_s']:.2f} GB/s" if "memcpy_gb_s" in lim else ""]
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", "| goal | measured | met |", "| --- | --- | --- |"]
    lines += [f"| {g} | {m} | {'yes' if ok else 'no'} |" for g, m, ok in GOALS(res)]
    env = res.get("environment", {})
    if env:
        lines += ["", f"{env['cpus']} CPUs, 1-minute load average {env['loadavg_1min_start']:.1f} at the start, "
                      f"{env['loadavg_1min_end']:.1f} at the end; the run took {res['run_s']:.0f} s."]
    return "\n".join(lines)


def plot(res: dict[str, Any], path: str) -> bool:
    """Bytes written per step, dedup on and off, one panel per workload; False without matplotlib."""
    try:
        import matplotlib
    except ImportError:
        return False
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    names = list(dict.fromkeys(c["workload"] for c in res["configs"]))
    fig, axes = plt.subplots(1, len(names), figsize=(4.5 * len(names), 3.6), squeeze=False)
    for ax, w in zip(axes[0], names):
        for c in res["configs"]:
            if c["workload"] != w:
                continue
            steps = [r["step"] for r in c["steps"]]
            ax.plot(steps, [r["bytes_written"] / MiB for r in c["steps"]], marker="o" if c["dedup"] else "x",
                    linestyle="-" if c["dedup"] else "--", label=f"{c['server']}, dedup {'on' if c['dedup'] else 'off'}")
        ys = [r["bytes_written"] / MiB for c in res["configs"] if c["workload"] == w for r in c["steps"]]
        ax.set_ylim(min(ys) / 2, max(ys) * 2)  # a decade at least: a flat line reads as flat
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_title(w)
        ax.set_xlabel("step")
        ax.set_ylabel("MiB written")
        ax.set_yscale("log")
        ax.grid(True, alpha=0.3)
    axes[0][0].legend(fontsize=7)  # tiers with the same bytes draw on top of one another
    fig.suptitle("bytes written to the durable tier per step" + (" (--quick)" if res["quick"] else ""))
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True
