"""bench/goodput.py (issue 32 item 4): the model's pure functions (bench/goodput_model.py)
against values computed by hand, where the failures fall, and a smoke run of `--quick`.

The smoke run takes about 2.5 minutes on a 2-core machine (SeaweedFS, 8 launches of a
2-rank torch job in network namespaces), too long for `make test`: it runs only with
TIERCEL_GOODPUT_SMOKE=1, as root, with SeaweedFS's `weed` installed:

    sudo TIERCEL_GOODPUT_SMOKE=1 python -m pytest -q tests/test_goodput_bench.py
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest

from conftest import PYTHON, TESTS_DIR, child_env

BENCH = TESTS_DIR.parent / "bench"
sys.path.insert(0, str(BENCH))

import goodput_model as gm  # noqa: E402

H = 3600.0


def test_young_and_daly_intervals():
    # sqrt(2 * 2 s * 3600 s) = 120 s.
    assert gm.young_interval(2, H) == pytest.approx(120.0)
    # Daly: 120 * (1 + sqrt(1/3600)/3 + (1/3600)/9) - 2 = 120 + 0.666667 + 0.003704 - 2.
    assert gm.young_daly_interval(2, H) == pytest.approx(118.670370, abs=1e-6)
    # A checkpoint costing more than twice the MTBF: checkpoint once per MTBF.
    assert gm.young_daly_interval(10, 4) == 4
    # 118.67 s in iterations of 0.5 s: 237.34, rounded.
    assert gm.interval_in_iterations(2, H, 0.5) == 237
    assert gm.interval_in_iterations(0.001, H, 100) == 1  # never below one iteration
    with pytest.raises(ValueError):
        gm.young_daly_interval(1, 0)


def test_ettr():
    # 100 s of compute per 1 s checkpoint, 10 s wasted per failure every 1000 s:
    # 100/101 * (1 - 10/1000) = 0.990099 * 0.99.
    assert gm.ettr(100, 1, 10, 1000) == pytest.approx(0.980198, abs=1e-6)
    assert gm.ettr(100, 0, 0, 1000) == 1.0
    assert gm.ettr(100, 1, 1000, 1000) == 0.0  # failures take all the time
    # At Young/Daly's interval (118.670370 s) for a 2 s checkpoint, 30 s restart, 10 s restore,
    # MTBF 1 h: waste = 40 + 120.670370 / 2 = 100.335185 s;
    # 118.670370 / 120.670370 * (1 - 100.335185 / 3600) = 0.983426 * 0.972129.
    assert gm.interval_ettr(2, 30, 10, H) == pytest.approx(0.956017, abs=1e-6)
    # The same in whole iterations of 0.5 s: 237 iterations = 118.5 s;
    # 118.5 / 120.5 * (1 - (40 + 60.25) / 3600) = 0.983402 * 0.972153.
    assert gm.interval_ettr(2, 30, 10, H, iteration=0.5) == pytest.approx(0.956017, abs=1e-6)
    # Every iteration: 1 s of compute, 10 ms added; a failure costs 30 + 2 s and redoes 1.5
    # steps of 1.01 s: 1 / 1.01 * (1 - 33.515 / 3600) = 0.990099 * 0.990690.
    assert gm.per_iteration_ettr(1, 0.01, 30, 2, 1, H) == pytest.approx(0.980881, abs=1e-6)
    c = gm.Costs(iteration=1, cost=0.01, restart=30, restore=2, every_iteration=True, lost_iterations=1)
    assert c.ettr(H) == gm.per_iteration_ettr(1, 0.01, 30, 2, 1, H)
    assert c.waste_per_failure(H) == pytest.approx(33.515)
    p = gm.Costs(iteration=0.5, cost=2, restart=30, restore=10)
    assert p.waste_per_failure(H) == pytest.approx(40 + (118.5 + 2) / 2)


def test_mtbf_follows_the_published_figures():
    assert gm.mtbf_of(1024) == pytest.approx(7.9 * H)
    assert gm.mtbf_of(16384) == pytest.approx(1.8 * H)
    # 4,096 is the geometric middle of 1,024 and 16,384: the MTBF is that of 7.9 h and 1.8 h.
    assert gm.mtbf_of(4096) == pytest.approx(math.sqrt(7.9 * 1.8) * H)
    # 16 GPUs: 7.9 h * 64^(ln(7.9/1.8)/ln(16)) = 7.9 h * 9.1946.
    assert gm.mtbf_of(16) / H == pytest.approx(72.637, abs=1e-3)
    assert gm.GPU_COUNTS[0] == 16 and gm.GPU_COUNTS[-1] == 16384
    curves = gm.curves({"x": gm.Costs(iteration=1, cost=1, restart=10, restore=1)})
    ettrs = [curves["x"][n] for n in gm.GPU_COUNTS]
    assert ettrs == sorted(ettrs, reverse=True)  # more GPUs, more failures, less training


def test_failures_fall_mid_interval():
    from goodput import failure_point

    # Checkpoints at 5, 15, 25, ...: a failure after 10 or 20 loses 5 iterations (k // 2).
    assert failure_point({"k": 10, "warmup": 5}, now=5, gap=2) == 10
    assert failure_point({"k": 10, "warmup": 5}, now=10, gap=2) == 20
    # Every iteration: just `gap` on.
    assert failure_point({"k": 1, "warmup": 5}, now=9, gap=6) == 15


@pytest.mark.skipif(os.environ.get("TIERCEL_GOODPUT_SMOKE") != "1",
                    reason="about 2.5 minutes: set TIERCEL_GOODPUT_SMOKE=1 (root, SeaweedFS's weed) to run it")
def test_quick_mode_runs_every_failure(tmp_path):
    out = tmp_path / "goodput"
    p = subprocess.run([PYTHON, str(BENCH / "goodput.py"), "--quick", "--out", str(out)], capture_output=True, text=True,
                       timeout=600, env=child_env(), cwd=str(TESTS_DIR.parent))
    assert p.returncode == 0, f"bench/goodput.py --quick exited {p.returncode}\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}"
    res = json.loads(out.with_suffix(".json").read_text())
    assert out.with_suffix(".md").exists() and out.with_suffix(".png").stat().st_size > 0
    fails = {(f["method"], f["kind"]): f for run in res["runs"].values() for f in run["failures"]}
    assert set(fails) == {("tiercel", "host"), ("tiercel", "preempt"), ("tiercel", "crash"), ("persist", "crash"),
                          ("dcp", "crash")}
    for f in fails.values():
        assert 0 <= f["restored_step"] and f["wasted_s"] > 0 and f["restart_s"] > 0, f
    # A host lost: the survivor's rank has its RAM, the lost one its peer's replica or the
    # bucket. Which step they share depends on how often the learned schedule replicated (a
    # loaded machine replicates less often), so the sources are reported, not asserted.
    host = fails["tiercel", "host"]
    assert host["restored_step"] >= res["runs"]["tiercel"]["plan"]["warmup"], host
    assert set(host["restored_from"]) <= {"ram", "peer", "bucket"} and host["tiers_at_failure"], host
    # Every host gone: only the bucket is left, and the notice put the newest step there.
    pre = fails["tiercel", "preempt"]
    assert pre["restored_from"] == ["bucket"] and len(pre["preempt_reports"]) == 2, pre
    assert all("holds step" in r for r in pre["preempt_reports"]), pre
    assert fails["tiercel", "crash"]["restored_from"] == ["bucket"]
    # The baselines checkpoint every k iterations and fail mid-interval: they lose work.
    for m in ("persist", "dcp"):
        assert res["runs"][m]["plan"]["k"] > 1 and fails[m, "crash"]["iterations_lost"] >= 1, res["runs"][m]
    assert set(res["model"]["ettr"]) == {"tiercel/host", "tiercel/preempt", "tiercel/crash", "persist", "dcp",
                                         "tiercel/host at Young/Daly's interval"}
