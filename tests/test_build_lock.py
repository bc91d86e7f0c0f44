"""Two clones running make at once on one machine (issue 28, item 19).

They share the virtualenv and the Rust build cache. The real Makefile runs here, from two
copies of the checkout at the same moment, with one virtualenv and one build cache; only the
slow tools are small stand-ins on PATH that record what they do and when: `maturin` (builds
for ~1 s, then points the virtualenv's tiercel.pth at its checkout, as `maturin develop`
does), the virtualenv's `python` (runs "the tests" for ~1 s, recording which checkout the
virtualenv pointed at while they ran) and `cargo` (records each `cargo clean`).

What must hold: the two builds never overlap, no clean happens during the other clone's
build, and each clone's tests import its own checkout from the first test to the last.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from pathlib import Path

from conftest import TESTS_DIR

REPO = TESTS_DIR.parent
WORK_S = 1.0  # how long each stand-in build and test run takes

# Every stand-in appends "<what> <event> <checkout> <time>" to $EVENTS; "the tests" add the
# checkout the virtualenv pointed at.
MATURIN = f"""#!/bin/sh
set -e
echo "build start $PWD $(date +%s.%N)" >>"$EVENTS"
sleep {WORK_S}
for sp in "$VIRTUAL_ENV"/lib/python*/site-packages; do echo "$PWD/python" >"$sp/tiercel.pth"; done
echo "build end $PWD $(date +%s.%N)" >>"$EVENTS"
"""
PYTHON = f"""#!/bin/sh
pth() {{ cat "$(dirname "$0")"/../lib/python*/site-packages/tiercel.pth 2>/dev/null || echo none; }}
echo "test start $PWD $(date +%s.%N) $(pth)" >>"$EVENTS"
sleep {WORK_S}
echo "test end $PWD $(date +%s.%N) $(pth)" >>"$EVENTS"
"""
CARGO = """#!/bin/sh
[ "$1" = clean ] && echo "clean at $PWD $(date +%s.%N)" >>"$EVENTS"
exit 0
"""


def _script(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    path.chmod(0o755)


def _checkout(dst: Path) -> Path:
    """The files the Makefile reads, copied: it, its lock script, and a few sources."""
    (dst / "tools").mkdir(parents=True)
    shutil.copy2(REPO / "Makefile", dst / "Makefile")
    shutil.copy2(REPO / "tools" / "shared-build-lock", dst / "tools" / "shared-build-lock")
    for name in ("requirements-dev.txt", "Cargo.toml", "pyproject.toml"):
        (dst / name).write_text("")
    (dst / "python" / "tiercel").mkdir(parents=True)
    (dst / "python" / "tiercel" / "__init__.py").write_text("")
    (dst / "rust").mkdir()
    return dst.resolve()


def _intervals(events: list[list[str]], what: str) -> dict[str, tuple[float, float]]:
    """{checkout: (start, end)} of `what` ("build", "test") from the event log."""
    out: dict[str, list[float]] = {}
    for kind, event, where, t, *_ in events:
        if kind == what:
            out.setdefault(where, []).append(float(t))
            assert event == ("start" if len(out[where]) == 1 else "end"), events
    return {k: (v[0], v[1]) for k, v in out.items()}


def test_two_clones_take_turns_with_the_shared_cache_and_virtualenv(tmp_path):
    shared = tmp_path / "shared"
    venv, target, events_log = shared / "venv", shared / "target", tmp_path / "events"
    _script(venv / "bin" / "maturin", MATURIN)
    _script(venv / "bin" / "python", PYTHON)
    _script(tmp_path / "tools" / "cargo", CARGO)
    (venv / "lib" / "python3.11" / "site-packages").mkdir(parents=True)
    a, b = _checkout(tmp_path / "a"), _checkout(tmp_path / "b")
    # The dependencies are installed (the stamp is newer than requirements-dev.txt).
    (venv / ".tiercel-deps").touch()
    old = time.time() - 60
    for c in (a, b):
        os.utime(c / "requirements-dev.txt", (old, old))

    env = {**os.environ, "EVENTS": str(events_log), "PATH": f"{tmp_path / 'tools'}:{os.environ['PATH']}"}
    env.pop("TIERCEL_BUILD_LOCKED", None)  # this test may itself run under `make test`'s lock
    env.pop("MAKEFLAGS", None)
    env.pop("MAKELEVEL", None)
    cmd = ["make", "--no-print-directory", "test-python", f"VENV={venv}", f"CARGO_TARGET_DIR={target}"]
    runs = [subprocess.Popen(cmd, cwd=c, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            for c in (a, b)]  # fmt: skip
    outs = [p.communicate(timeout=60)[0] for p in runs]
    for p, out in zip(runs, outs):
        assert p.returncode == 0, out

    events = [line.split() for line in events_log.read_text().splitlines()]
    builds, tests = _intervals(events, "build"), _intervals(events, "test")
    a, b = str(a), str(b)
    assert set(builds) == set(tests) == {a, b}, events

    # Each clone holds the lock from its build to its last test: the spans do not overlap.
    spans = {c: (builds[c][0], tests[c][1]) for c in builds}
    (s1, e1), (s2, e2) = sorted(spans.values())
    assert e1 <= s2, f"the two clones' build-and-test spans overlap: {spans}\n{events}"

    # Each clone's tests ran with the virtualenv pointing at its own checkout, start to end.
    for kind, _event, where, _t, *pth in events:
        if kind == "test":
            assert pth == [f"{where}/python"], f"{where}'s tests imported {pth}\n{events}"

    # The build cache was cleaned when it changed hands, never during the other clone's span.
    cleans = [(where, float(t)) for kind, _e, where, t, *_ in events if kind == "clean"]
    assert {w for w, _ in cleans} == {a, b}, events
    for where, t in cleans:
        other = b if where == a else a
        start, end = spans[other]
        assert not start <= t <= end, f"{where} cleaned the cache during {other}'s build or tests\n{events}"
    assert (target / ".tiercel-checkout").read_text().strip() in (a, b)

    # The clone that came second said what it waited for (when it did wait: on a loaded machine
    # it may have started only after the first was done).
    if s2 - e1 < 0.5:
        assert any("waiting for" in out for out in outs), outs
