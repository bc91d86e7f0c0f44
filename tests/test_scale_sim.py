"""The restore-agreement simulator of bench/scale.py (bench/_agree_sim.py): tiercel's own
`newest.agree` by N rank threads over a KVStoreCoordinator on a simulated TCPStore. Its
store-call count is the formula of docs/scale.md ("Coordination": 4N + 5 per round, two
rounds: the steps in common, then the verdict on the newest), and every rank picks the same
step. The save simulator's own test is in rust/tiercel-core/src/testing/sim/tests.rs."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))

import _agree_sim  # noqa: E402


@pytest.mark.parametrize("ranks", [8, 32])
def test_agreement_costs_the_formula_and_all_ranks_agree(ranks: int) -> None:
    r = _agree_sim.run(ranks, latency=0.0005, service=0.0)
    assert r.errors == []
    assert r.steps == {3}, "the ranks did not all pick the newest step they all have"
    assert r.ops == 2 * (4 * ranks + 5), r.ops_by_kind
    assert r.ops_by_kind["get"] == 2 * ranks  # N - 1 results and one read of every value, per round


def test_a_step_one_rank_lacks_is_passed_over() -> None:
    r = _agree_sim.run(8, latency=0.0005, service=0.0, lacking={5: 3})
    assert r.errors == []
    assert r.steps == {2}, r.steps
