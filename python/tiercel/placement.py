"""GEMINI placement of in-memory checkpoint replicas over hosts, and how likely a burst of
host failures is to lose every copy of some host's shards.

The failure domain is the host: every copy of a host's shards lives on a distinct host
(ranks on one host never count as each other's replicas). The computation is in Rust
(`tiercel_core::placement`); this module only formats it. `report()` backs
`tiercel placement --hosts N --replicas m --failures k`, `summary()` its `--json`.
"""

from __future__ import annotations

import math
from typing import Any

from ._core import TiercelError
from ._core import placement as _placement
from ._text import count

__all__ = ["placement", "report", "summary"]

STRATEGIES = ("group", "ring", "mixed")


def placement(
    hosts: int, replicas: int, strategy: str = "mixed", failures: int | None = None
) -> tuple[list[list[int]], list[list[int]], float | None, float | None]:
    """(groups, then the ring part if any; holders per host, itself first; the exact
    probability that no host loses every copy when `failures` hosts fail at once; GEMINI's
    closed form when `replicas` divides `hosts`)."""
    return _placement(hosts, replicas, strategy, failures)


def _hosts(hs: list[int]) -> str:
    return " ".join(str(h) for h in hs)


def _shape(strategy: str, groups: list[list[int]], m: int) -> str:
    parts = []
    for g in groups:
        if strategy == "ring" or len(g) != m:
            parts.append(f"ring ({_hosts(g)}), each host's copies on itself and the next {m - 1}")
        else:
            parts.append(f"[{_hosts(g)}]")
    return "groups " + " ".join(parts) if strategy != "ring" else parts[0]


def _prob_line(p: float, good: int | None, total: int) -> str:
    line = f"P(no host loses every copy) = {p:.12f}   P(some host loses all) = {1.0 - p:.6g}"
    if good is not None:
        line += f"   ({good} of {total} failure sets are survivable)"
    return line


def summary(hosts: int, replicas: int, failures: int | None = None) -> dict[str, Any]:
    """What `report` prints, as data (`tiercel placement --json`): per strategy its groups (or
    why it is not possible), the holders of each host's copies and, for `failures` hosts
    failing at once, the exact survival probability and count, plus GEMINI's closed form
    where it applies, marked exact (m <= k < 2m) or a lower bound (k >= 2m)."""
    n, m, k = hosts, replicas, failures
    total = math.comb(n, k) if k is not None and 0 <= k <= n else 0
    out: dict[str, Any] = {"hosts": n, "replicas": m, "failures": k, "failure_sets": total or None, "strategies": {}}
    for strategy in STRATEGIES:
        entry: dict[str, Any] = {"possible": True}
        out["strategies"][strategy] = entry
        if strategy == "group" and m >= 1 and n % m != 0:
            entry.update(possible=False, why=f"{m} does not divide {n}")
            continue
        try:
            groups, holders, exact, closed = placement(n, m, strategy, k)
            note = None
        except TiercelError as e:
            if k is None:
                raise
            groups, holders, exact, closed = placement(n, m, strategy, None)
            note = str(e)
        entry.update(groups=groups, holders=holders)
        if k is None:
            continue
        entry["p_survive"] = exact
        if note is not None or exact is None:
            entry["unavailable"] = note
        elif total < 2**50:  # the count is exact in a double
            entry["survivable_sets"] = round(exact * total)
        if strategy == "group" and closed is not None:
            if k < m:
                tag = "exact: k < m, no host can lose every copy"
            elif k < 2 * m:
                tag = "exact: m <= k < 2m, at most one group can fail whole"
            else:
                tag = "NOT exact: k >= 2m, two groups can fail whole; it is a lower bound"
            entry["closed_form"] = {"p_survive": closed, "exact": k < 2 * m, "note": tag}
    return out


def report(hosts: int, replicas: int, failures: int | None = None) -> str:
    """The groups of each placement strategy (group when `replicas` divides `hosts`, ring,
    mixed) and, for `failures` hosts failing at once (chosen uniformly at random), the exact
    probability that no host loses every copy of its shards, plus GEMINI's closed form where
    it applies (group placement), marked exact (m <= k < 2m) or a lower bound (k >= 2m)."""
    doc = summary(hosts, replicas, failures)
    n, m, k = hosts, replicas, failures
    head = f"{count(n, 'host')}, {m} copies of each host's shards (the host itself + {count(m - 1, 'peer')})"
    if k is not None:
        head += f", {count(k, 'host')} failing at once"
    lines = [head, "failure domain: the host; probabilities are exact counts over all failure sets"]
    for strategy, entry in doc["strategies"].items():
        lines.append("")
        if not entry["possible"]:
            lines.append(f"group: not possible ({entry['why']}); see mixed")
            continue
        shape = _shape(strategy, entry["groups"], m)
        if strategy == "mixed" and n % m == 0:
            shape += f"  (the same as group: {m} divides {n})"
        lines.append(f"{strategy}: {shape}")
        if k is None:
            continue
        if entry["p_survive"] is None or "unavailable" in entry:
            lines.append(f"  exact probability unavailable: {entry.get('unavailable')}")
        else:
            lines.append("  " + _prob_line(entry["p_survive"], entry.get("survivable_sets"), doc["failure_sets"]))
        closed = entry.get("closed_form")
        if closed is not None:
            lines.append(f"  GEMINI closed form 1 - N*C(N-m,k-m)/(m*C(N,k)) = {closed['p_survive']:.12f}   ({closed['note']})")
    return "\n".join(lines)
