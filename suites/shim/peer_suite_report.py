"""pytest plugin (-p peer_suite_report): appends each test's outcome to
$TIERCEL_PEER_SUITE_REPORT as one JSON line when the test ends, so that a run cut short
(a hang, the runner's time limit) still reports every test that finished. For Orbax it also
lets `orbax.checkpoint._src.testing` (a namespace package without its test helpers in the
wheel) find the fetched helpers ($TIERCEL_PEER_SUITE_ORBAX_TESTING), marks absl's flags
parsed and starts JAX's distributed runtime with one process, as Orbax's test launcher does."""

from __future__ import annotations

import json
import os
from typing import Any

_outcomes: dict[str, str] = {}
_why: dict[str, str] = {}


def _write(record: dict[str, Any]) -> None:
    with open(os.environ["TIERCEL_PEER_SUITE_REPORT"], "a") as f:
        f.write(json.dumps(record) + "\n")


def pytest_configure(config: Any) -> None:
    extra = os.environ.get("TIERCEL_PEER_SUITE_ORBAX_TESTING")
    if extra:
        import socket

        import jax
        import orbax.checkpoint._src.testing as testing
        from absl import flags

        testing.__path__.append(extra)
        # absltest's flags (--test_tmpdir, ...) at their defaults, as absltest.main would parse them.
        flags.FLAGS.mark_as_parsed()
        # Orbax's MultiProcessTest meets its processes at JAX's coordination service: a job
        # of one process here, as its launcher starts with --num_processes=1.
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        jax.distributed.initialize(coordinator_address=f"127.0.0.1:{port}", num_processes=1, process_id=0)


def pytest_collection_finish(session: Any) -> None:
    _write({"collected": [item.nodeid for item in session.items]})


def pytest_runtest_logreport(report: Any) -> None:
    # A test passed when its call passed and neither its setup nor its teardown failed.
    if report.failed:
        _outcomes[report.nodeid] = "failed"
        # The whole report, with the captured output where a spawned rank printed its error.
        text = str(report.longrepr) + "".join(f"\n{content}" for _name, content in report.sections)
        _why.setdefault(report.nodeid, text[-20000:])
    elif report.skipped and report.nodeid not in _outcomes:
        _outcomes[report.nodeid] = "skipped"
    elif report.when == "call" and report.passed:
        _outcomes.setdefault(report.nodeid, "passed")
    if report.when == "teardown":
        record = {"test": report.nodeid, "outcome": _outcomes.get(report.nodeid, "failed")}
        if record["outcome"] == "failed":
            record["why"] = _why.get(report.nodeid, "")
        _write(record)
