#!/usr/bin/env python
"""The frameworks' own checkpoint test suites, run twice: on their stock backend and with
tiercel in its place (`make peer-suites`; docs/peer-suites.md).

    python suites/run.py                      # all suites, both backends
    python suites/run.py --suite dcp --backend tiercel
    python suites/run.py --from-git deepspeed=~/src/DeepSpeed/.git   # no access to GitHub

Suites (the test files are fetched from GitHub at a pinned commit, suites/upstream.py):
  deepspeed      DeepSpeed's tests/unit/checkpoint: latest, tag validation, LR scheduler,
                 other optimizers, shared weights, ZeRO save/load edge cases (CPU accelerator,
                 gloo; on the CPU its LR-scheduler and two optimizer tests skip themselves)
  orbax-handler  Orbax's standard_checkpoint_handler_test
  orbax-manager  Orbax's checkpoint_manager_test
  dcp            torch's test/distributed/checkpoint/test_file_system_checkpoint_cpu.py

The substitution is suites/shim/sitecustomize.py. Orbax's tests need flax, optax and
portpicker, torch's expecttest: they are installed once into the cache (pip --target, pinned in
suites/requirements.txt), never into the virtualenv. Prints a table: tests, passed with the
stock backend, passed with tiercel, and the tests that fail only with tiercel (with why).
Informational: exits 0 whatever the counts, 2 when a suite could not be run at all.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from suites.upstream import DEEPSPEED, ORBAX, TORCH, FetchError, Upstream, fetch  # noqa: E402

SHIM = HERE / "shim"
REQUIREMENTS = HERE / "requirements.txt"
DEFAULT_CACHE = Path.home() / ".cache" / "tiercel" / "peer-suites"


@dataclasses.dataclass(frozen=True)
class Suite:
    name: str
    label: str
    upstream: Upstream
    cwd: str  # inside the fetched tree
    targets: tuple[str, ...]
    env: tuple[tuple[str, str], ...] = ()
    needs_deps: bool = False


_ORBAX_TESTING = "checkpoint/orbax/checkpoint/_src/testing"
SUITES = {
    s.name: s
    for s in (
        Suite(
            "deepspeed",
            "DeepSpeed tests/unit/checkpoint (6 files)",
            DEEPSPEED,
            "tests",
            tuple(f"unit/checkpoint/test_{n}.py" for n in ("latest_checkpoint", "tag_validation", "lr_scheduler",
                                                           "other_optimizer", "shared_weights"))
            + ("unit/checkpoint/test_zero_optimizer.py::TestZeROSaveLoadEdgeCase",),
            # LOCAL_SIZE: the CPU accelerator's device count, so that the two-rank tests run.
            (("DS_ACCELERATOR", "cpu"), ("LOCAL_SIZE", "2")),
        ),  # fmt: skip
        Suite(
            "orbax-handler",
            "Orbax standard_checkpoint_handler_test",
            ORBAX,
            ".",
            ("checkpoint/orbax/checkpoint/_src/handlers/standard_checkpoint_handler_test.py",),
            (("JAX_PLATFORMS", "cpu"), ("XLA_FLAGS", "--xla_force_host_platform_device_count=8")),
            needs_deps=True,
        ),
        Suite(
            "orbax-manager",
            "Orbax checkpoint_manager_test",
            ORBAX,
            ".",
            ("checkpoint/orbax/checkpoint/checkpoint_manager_test.py",),
            (("JAX_PLATFORMS", "cpu"), ("XLA_FLAGS", "--xla_force_host_platform_device_count=8")),
            needs_deps=True,
        ),
        Suite("dcp", "DCP test_file_system_checkpoint_cpu", TORCH, ".",
              ("test/distributed/checkpoint/test_file_system_checkpoint_cpu.py",), needs_deps=True),  # fmt: skip
    )
}


@dataclasses.dataclass
class Result:
    collected: list[str]
    outcomes: dict[str, str]  # test -> passed / failed / skipped
    why: dict[str, str]
    seconds: float
    note: str = ""  # "timed out", "exit code N" when the run did not end normally

    @property
    def passed(self) -> int:
        return sum(o == "passed" for o in self.outcomes.values())


def install_deps(cache: Path) -> Path:
    """Orbax's test dependencies, into the cache (pip --target --no-deps: every package is
    pinned in suites/requirements.txt; the virtualenv is left as it is)."""
    deps = cache / "deps"
    stamp = deps / ".requirements"
    wanted = REQUIREMENTS.read_text()
    if stamp.exists() and stamp.read_text() == wanted:
        return deps
    print(f"==> installing the suites' test dependencies into {deps} ({REQUIREMENTS.name})", flush=True)
    shutil.rmtree(deps, ignore_errors=True)
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(deps), "-r", str(REQUIREMENTS)],
                   check=True)  # fmt: skip
    stamp.write_text(wanted)
    return deps


def run_suite(suite: Suite, backend: str, src: Path, deps: Path | None, out: Path, timeout: float, select: str | None) -> Result:
    report = out / f"{suite.name}-{backend}.jsonl"
    report.unlink(missing_ok=True)
    shm = Path("/dev/shm") if Path("/dev/shm").is_dir() else out
    root = shm / f"tiercel-peer-suite-{os.getpid()}-{suite.name}-{backend}"
    paths = [str(SHIM)] + ([str(deps)] if deps else []) + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    tmp = Path(tempfile.mkdtemp(prefix=f"tiercel-peer-suite-{suite.name}-{backend}-"))
    env = {
        **os.environ,
        **dict(suite.env),
        "TEST_TMPDIR": str(tmp),  # absltest's temporary directories: fresh for each run
        "PYTHONPATH": os.pathsep.join(paths),
        "TIERCEL_PEER_SUITE": backend,
        "TIERCEL_PEER_SUITE_ROOT": str(root),
        "TIERCEL_PEER_SUITE_REPORT": str(report),
        "OMP_NUM_THREADS": "1",
        # The virtualenv's tools (ninja, which DeepSpeed's JIT-compiled ops need) on PATH.
        "PATH": os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")]),
        # DeepSpeed's CPU ops, compiled once and shared with tests/test_deepspeed.py.
        "TORCH_EXTENSIONS_DIR": os.environ.get("TORCH_EXTENSIONS_DIR", str(Path.home() / ".cache" / "tiercel" / "torch_extensions")),
    }
    if suite.upstream is ORBAX:
        env["TIERCEL_PEER_SUITE_ORBAX_TESTING"] = str(src / _ORBAX_TESTING)
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "peer_suite_report", *suite.targets]
    if select:
        cmd += ["-k", select]
    log = out / f"{suite.name}-{backend}.log"
    t0 = time.monotonic()
    note = ""
    with log.open("w") as logf:
        proc = subprocess.Popen(cmd, cwd=src / suite.cwd, env=env, stdout=logf, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            rc = proc.wait(timeout=timeout)
            if rc not in (0, 1):  # 1: some tests failed
                note = f"pytest exit code {rc}"
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            note = f"timed out after {timeout:.0f} s"
    shutil.rmtree(root, ignore_errors=True)
    shutil.rmtree(tmp, ignore_errors=True)
    result = read_report(report, time.monotonic() - t0, note)
    if not result.collected and not note:
        result.note = f"nothing collected (see {log})"
    return result


def read_report(report: Path, seconds: float = 0.0, note: str = "") -> Result:
    """A run's outcomes from peer_suite_report's lines (several runs' lines may be joined)."""
    collected: list[str] = []
    outcomes: dict[str, str] = {}
    why: dict[str, str] = {}
    if report.exists():
        for line in report.read_text().splitlines():
            rec = json.loads(line)
            if "collected" in rec:
                collected += [t for t in rec["collected"] if t not in collected]
            else:
                outcomes[rec["test"]] = rec["outcome"]
                if rec.get("why"):
                    why[rec["test"]] = rec["why"]
    return Result(collected, outcomes, why, seconds, note)


def headline(why: str) -> str:
    """The line of a failure report that names the error: tiercel's own when there is one
    (a spawned rank's, or the cause DCP wraps in a CheckpointException), else the last."""
    lines = [re.sub(r"^E\s+", "", line.strip()) for line in why.splitlines()]
    named = [line for line in lines if re.match(r"^[\w.]*(Error|Exception)\b:", line)]
    ours = [line for line in named if line.startswith("tiercel.") or "tiercel" in line.split(":", 1)[0]]
    best = ours[-1] if ours else named[-1] if named else next((line for line in lines if line), "")
    return best[:220]


def table(rows: list[tuple[Suite, dict[str, Result]]]) -> str:
    lines = [
        "| suite | tests | passed, stock | passed, tiercel |",
        "| --- | ---: | ---: | ---: |",
    ]
    for suite, res in rows:
        tests = max((len(r.collected) for r in res.values()), default=0)
        cells = []
        for backend in ("stock", "tiercel"):
            r = res.get(backend)
            cells.append("-" if r is None else f"{r.passed}" + (f" ({r.note})" if r.note else ""))
        lines.append(f"| {suite.label} | {tests} | {cells[0]} | {cells[1]} |")
    out = "\n".join(lines)
    for suite, res in rows:
        stock, tc = res.get("stock"), res.get("tiercel")
        if stock is None or tc is None:
            continue
        only = [t for t in tc.collected if stock.outcomes.get(t) == "passed" and tc.outcomes.get(t) != "passed"]
        if only:
            out += f"\n\n{suite.label}: failing only with tiercel ({len(only)}):"
            for t in only:
                out += f"\n  {t.split('/')[-1]}: {headline(tc.why.get(t, '')) or tc.outcomes.get(t, 'not run')}"
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--suite", action="append", choices=sorted(SUITES), help="a suite (repeatable; default: all)")
    ap.add_argument("--backend", choices=("both", "stock", "tiercel"), default="both")
    ap.add_argument("--from-git", action="append", default=[], metavar="NAME=GIT_DIR",
                    help="take a framework's test files from a local clone (deepspeed, orbax, torch)")  # fmt: skip
    ap.add_argument("--cache", type=Path, default=DEFAULT_CACHE, help=f"fetched files, test dependencies (default {DEFAULT_CACHE})")
    ap.add_argument("-k", dest="select", help="only the tests pytest -k selects (for a quick look)")
    ap.add_argument("--results", type=Path, help="where the logs and outcomes go (default CACHE/results)")
    ap.add_argument("--report-only", action="store_true", help="print the table of the outcomes in --results, run nothing")
    ap.add_argument("--timeout", type=float, default=2400, help="seconds per suite and backend (default 2400)")
    args = ap.parse_args()

    git_dirs = {}
    for spec in args.from_git:
        name, _, path = spec.partition("=")
        git_dirs[name] = Path(path).expanduser()
    out = args.results or args.cache / "results"
    out.mkdir(parents=True, exist_ok=True)
    backends = ("stock", "tiercel") if args.backend == "both" else (args.backend,)
    rows: list[tuple[Suite, dict[str, Result]]] = []
    failed = False
    for name in args.suite or list(SUITES):
        suite = SUITES[name]
        if args.report_only:
            rows.append((suite, {b: read_report(out / f"{name}-{b}.jsonl") for b in backends if (out / f"{name}-{b}.jsonl").exists()}))
            continue
        try:
            src = fetch(suite.upstream, args.cache, git_dirs.get(suite.upstream.name))
            deps = install_deps(args.cache) if suite.needs_deps else None
        except (FetchError, subprocess.CalledProcessError) as e:
            print(f"{suite.label}: cannot run: {e}", file=sys.stderr, flush=True)
            failed = True
            continue
        res: dict[str, Result] = {}
        for backend in backends:
            print(f"==> {suite.label}, {backend} backend ...", flush=True)
            r = res[backend] = run_suite(suite, backend, src, deps, out, args.timeout, args.select)
            print(f"    {r.passed} of {len(r.collected)} passed in {r.seconds:.0f} s {r.note} "
                  f"(log: {out / f'{suite.name}-{backend}.log'})", flush=True)  # fmt: skip
        rows.append((suite, res))
    text = table(rows)
    print("\n" + text)
    (out / "last.md").write_text(text + "\n")
    return 2 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
