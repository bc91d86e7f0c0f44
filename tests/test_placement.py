"""GEMINI placement: the report's numbers against brute-force enumeration of failure sets."""

from __future__ import annotations

import itertools
import math
import re

import pytest

import tiercel
from tiercel.placement import placement, report


def brute_force(holders: list[list[int]], k: int) -> tuple[int, int]:
    """(failure sets of k hosts after which every host still has a copy, all of them)."""
    n = len(holders)
    good = total = 0
    for failed in itertools.combinations(range(n), k):
        f = set(failed)
        total += 1
        good += all(not set(h) <= f for h in holders)
    return good, total


def expected_holders(n: int, m: int, strategy: str) -> list[list[int]]:
    """The placement rules written out independently of the Rust code."""
    if strategy == "ring":
        cycles = [list(range(n))]
    elif n % m == 0:
        cycles = [list(range(g, g + m)) for g in range(0, n, m)]
    else:
        full = n // m - 1
        cycles = [list(range(g * m, g * m + m)) for g in range(full)] + [list(range(full * m, n))]
    holders: list[list[int]] = [[] for _ in range(n)]
    for c in cycles:
        for i, h in enumerate(c):
            holders[h] = [c[(i + d) % len(c)] for d in range(m)]
    return holders


def section(text: str, strategy: str) -> str:
    return re.search(rf"^{strategy}:.*?(?=^\w|\Z)", text, re.S | re.M).group(0)


def survival(block: str) -> float:
    return float(re.search(r"P\(no host loses every copy\) = ([0-9.]+)", block).group(1))


def test_report_8_hosts_2_replicas_2_failures():
    n, m, k = 8, 2, 2
    text = report(n, m, k)
    print(text)
    assert text.startswith("8 hosts, 2 copies")

    want = {s: brute_force(expected_holders(n, m, s), k) for s in ("group", "ring", "mixed")}
    assert want["group"] == (24, 28)  # the 4 whole groups are the only fatal pairs
    assert want["ring"] == (20, 28)  # the 8 adjacent pairs of the ring
    for s, (good, total) in want.items():
        block = section(text, s)
        assert survival(block) == pytest.approx(good / total, abs=1e-12), block
        assert f"({good} of {total} failure sets are survivable)" in block

    group = section(text, "group")
    assert "groups [0 1] [2 3] [4 5] [6 7]" in group
    closed = float(re.search(r"GEMINI closed form .*? = ([0-9.]+)", group).group(1))
    assert closed == pytest.approx(1 - n * math.comb(n - m, k - m) / (m * math.comb(n, k)), abs=1e-12)
    assert closed == pytest.approx(24 / 28, abs=1e-12)
    assert "(exact: m <= k < 2m" in group
    assert "ring (0 1 2 3 4 5 6 7)" in section(text, "ring")
    assert "the same as group" in section(text, "mixed")


def test_report_marks_closed_form_not_exact_and_missing_group():
    text = report(8, 2, 4)
    group = section(text, "group")
    assert survival(group) == pytest.approx(16 / 70, abs=1e-12)
    assert "NOT exact" in group and "lower bound" in group

    text = report(8, 3, 4)
    assert "group: not possible (3 does not divide 8)" in text
    assert "GEMINI closed form" not in text
    mixed = section(text, "mixed")
    assert "groups [0 1 2] ring (3 4 5 6 7)" in mixed
    assert survival(mixed) == pytest.approx(
        brute_force(expected_holders(8, 3, "mixed"), 4)[0] / 70, abs=1e-12
    )


@pytest.mark.parametrize("n", range(1, 10))
def test_binding_matches_brute_force(n):
    for m in range(1, n + 1):
        for s in ("group", "ring", "mixed"):
            if s == "group" and n % m:
                with pytest.raises(tiercel.InvalidArgumentError, match="does not divide"):
                    placement(n, m, s)
                continue
            for k in range(n + 1):
                groups, holders, exact, closed = placement(n, m, s, k)
                assert holders == expected_holders(n, m, s)
                assert sorted(h for g in groups for h in g) == list(range(n))
                good, total = brute_force(holders, k)
                assert exact == pytest.approx(good / total, abs=1e-12)
                assert (closed is None) == (n % m != 0)


def test_binding_errors():
    with pytest.raises(tiercel.InvalidArgumentError, match="unknown placement strategy"):
        placement(4, 2, "star")
    with pytest.raises(tiercel.InvalidArgumentError, match="exceeds hosts"):
        placement(4, 5, "ring")
    with pytest.raises(tiercel.InvalidArgumentError, match="failures = 5 exceeds hosts = 4"):
        placement(4, 2, "ring", 5)
    assert placement(4, 2, "mixed")[2:] == (None, None)
