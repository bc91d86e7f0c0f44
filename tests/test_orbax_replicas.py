"""A JAX job's data-parallel replicas restore from the bucket reading each byte once: 2
processes on 2 "hosts" (own TIERCEL_HOST and shared-memory root), 2 CPU devices each, one
replica per process; Orbax's CheckpointManager with tiercel.orbax's handler; one S3 server
(moto) reached through a proxy per phase that counts the bytes the bucket serves.

Process 0 saves each shard once (replica 0). With both hosts' RAM wiped, `all` reads the
shards twice from the bucket (each process needs every one); `single` and `striped` read them
once and pass them over the relay, bit-identical (tests/orbax_worker.py checks every shard).
A chunk corrupted on the wire is refused and read from the bucket instead. The failure paths
of the relay itself (a rank dying on either end) are tests/test_replicas.py's, on the same
code. The job's code is tests/orbax_worker.py ("replicas" phase)."""

from __future__ import annotations

import shutil

import pytest
from test_orbax import run_job

from conftest import new_shm_root
from faultproxy import FaultProxy
from orbax_state import COLS, ROWS
from servers import moto_server, s3_env  # noqa: F401 (fixtures)

pytest.importorskip("jax")
pytest.importorskip("orbax.checkpoint")

KiB = 1024
#: One copy of the state's arrays: the matrix, the vector and the scalar.
ONE_COPY = ROWS * COLS * 4 + COLS * 4 + 4
MODES = ("all", "single", "striped")


def run_replicas(server, tmp_path, modes: tuple[str, ...], failpoint: str | None = None) -> tuple[list[dict], dict[str, int]]:
    """Saves once, then restores in each of `modes` with both hosts' RAM wiped; returns each
    process's report and the bytes the bucket served per mode. `failpoint` arms process 0."""
    bucket = server.new_bucket()
    roots = [new_shm_root(f"orbax-replicas{h}-") for h in range(2)]
    proxies = {name: FaultProxy(server.endpoint, faults={}) for name in ("save", *modes)}
    try:

        def policy(pid: int, name: str) -> dict:
            return {
                "tier": [{"name": "ram", "kind": "memory", "root": str(roots[pid])},
                         {"name": "s3", "kind": "s3", "url": f"s3://{bucket}/ckpt", "endpoint": proxies[name].endpoint,
                          "allow_http": True, "compression": "none"}],
                "restore": {"order": ["ram", "s3"], "replicated": name if name != "save" else "all",
                            "relay_window": "128KiB", "relay_timeout": 20},
                "store": {"chunk_size": "64KiB", "threads": 2, "io_threads": 2},
            }

        def cfg_of(pid: int) -> dict:
            return {"policies": {name: policy(pid, name) for name in proxies}, "modes": list(modes),
                    "dir": str(tmp_path / "orbax"), "host": f"host{pid}",
                    "failpoint": failpoint if pid == 0 else None}

        reports = run_job(tmp_path, "replicas", cfg_of, nproc=2, ndev=2)
        # The rank that completes the step in the bucket sees it committed, the other written.
        assert all(r["states"]["s3"] in ("committed", "written") for r in reports), reports
        assert any(r["states"]["s3"] == "committed" for r in reports), reports
        return reports, {m: proxies[m].downloaded for m in modes}
    finally:
        for p in proxies.values():
            p.close()
        for r in roots:
            shutil.rmtree(r, ignore_errors=True)


def test_data_parallel_replicas_read_the_bucket_once(moto_server, s3_env, tmp_path):  # noqa: F811 (fixtures)
    reports, served = run_replicas(moto_server, tmp_path, MODES)
    # Manifests, listings and heads on top of the data: far less than a copy.
    slack = 128 * KiB
    assert 2 * ONE_COPY <= served["all"] < 2 * ONE_COPY + slack, served
    for mode in ("single", "striped"):
        assert ONE_COPY <= served[mode] < ONE_COPY + slack, (mode, served)
        stats = [r["modes"][mode]["broadcast"] for r in reports]
        assert all(s and s["mode"] == mode and s["fallbacks"] == 0 and not s["warnings"] for s in stats), stats
        assert sum(s["bytes_read"] for s in stats) == ONE_COPY, stats
        assert sum(s["bytes_received"] for s in stats) == ONE_COPY, stats
    assert all(r["modes"]["all"]["broadcast"] is None for r in reports), reports
    # single: process 0 reads it all and passes it on; striped: each reads about half.
    assert [s["bytes_read"] for s in (r["modes"]["single"]["broadcast"] for r in reports)] == [ONE_COPY, 0]
    halves = [r["modes"]["striped"]["broadcast"]["bytes_read"] for r in reports]
    assert all(abs(h - ONE_COPY / 2) <= 64 * KiB for h in halves), halves


def test_a_chunk_corrupted_on_the_wire_is_read_from_the_bucket(moto_server, s3_env, tmp_path):  # noqa: F811 (fixtures)
    # Process 0 flips a bit in the 2nd chunk it sends; process 1 refuses it (its checksum),
    # reads that chunk from the bucket and still restores every shard bit-identical.
    reports, served = run_replicas(moto_server, tmp_path, ("single",), failpoint="relay_corrupt:2")
    got = reports[1]["modes"]["single"]["broadcast"]
    assert got["fallbacks"] == 1 and any("checksum" in w for w in got["warnings"]), got
    assert got["bytes_read"] <= 64 * KiB and got["bytes_received"] >= ONE_COPY - 64 * KiB, got
    assert ONE_COPY < served["single"] < ONE_COPY + 64 * KiB + 128 * KiB, served
