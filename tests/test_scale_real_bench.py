"""bench/scale_real.py runs and counts what docs/scale.md's "Commit" table says: 4 real ranks on
moto, every request counted at the server's side by rank and step. A fresh process's first
step costs exactly 3N + 4 requests (data, manifest and a listing of its area per rank; the
committer's record and retention); in the steady state a rank that does not commit makes 3
(data, manifest, 1 DeleteObjects: the commits its sweep needs come from the counter), only the
committer lists; the step costs about 3N + 6 in all, and up to 4 more when the committer is
new to the role (it reads the records of the kept step and of its own once).
About 40 s; TIERCEL_SCALE_REAL_SMOKE=0 leaves it out."""

from __future__ import annotations

import json
import os
import subprocess

import pytest

from conftest import PYTHON, TESTS_DIR, child_env

BENCH = TESTS_DIR.parent / "bench/scale_real.py"
N = 4
KEEP = 1  # bench/scale_real.py's


@pytest.mark.skipif(os.environ.get("TIERCEL_SCALE_REAL_SMOKE") == "0", reason="TIERCEL_SCALE_REAL_SMOKE=0")
def test_scale_real_counts_four_ranks_on_moto(tmp_path):
    out = tmp_path / "scale-real"
    p = subprocess.run([PYTHON, str(BENCH), "--ranks", str(N), "--servers", "moto", "--no-sim", "--steps", "4",
                        "--timeout", "120", "--out", str(out)], capture_output=True, text=True, timeout=300,
                       env=child_env(), cwd=str(TESTS_DIR.parent))
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    run = json.loads(out.with_suffix(".json").read_text())["runs"][0]
    steps = [ph for ph in run["phases"] if ph["phase"] != "open"]
    assert [ph["phase"] for ph in steps] == [1, 2, 3, 4]
    first = steps[0]
    assert first["requests"] == 3 * N + 4, f"first step: {first['by_kind']}, by rank {first['per_rank']}"
    assert first["by_kind"]["LIST"] == N + 1 and first["by_kind"]["PUT"] == 2 * N + 1, first["by_kind"]
    for ph in steps[2:]:  # the steady state
        what = json.dumps({k: ph[k] for k in ("by_kind", "per_rank", "busiest_log")})
        assert ph["median_rank"] == 3, what
        assert ph["by_kind"]["LIST"] == 2 and ph["by_kind"]["PUT"] == 2 * N + 1, what
        # Around 3N + 6 to 3N + 8; a committer that did not commit the step before also reads the
        # commit records of the kept step and of its own (a HEAD and a GET each, once per
        # process: whether they are another job's, before retention removes one): up to 4 more.
        assert 3 * N + 4 <= ph["requests"] <= 3 * N + 8 + 2 * (KEEP + 1), what
        assert ph["busiest_requests"] <= 3 + 12, what
    assert out.with_suffix(".md").read_text().count("| moto | 4 |") == 2
