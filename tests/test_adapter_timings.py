"""The framework adapters' timings reach `store.metrics().timings` and the Prometheus text:
DCP's async_save staging and an Orbax save's blocking part, measured by really saving
through them (DeepSpeed's stall: tests/test_deepspeed.py, where a snapshot races the next
optimizer step)."""

from __future__ import annotations

import re
import warnings
from typing import Any

import pytest
import torch

import tiercel
import tiercel.metrics

from conftest import make_policy, run_isolated


def timings_in_text(store: tiercel.Store) -> dict[tuple[str, str], float]:
    """(sample name, timing) -> value, of the Prometheus text's timing samples."""
    sample = re.compile(r'^(tiercel_timing_\w+)\{timing="(\w+)",rank="0"\} (\S+)$', re.M)
    return {(name, timing): float(v) for name, timing, v in sample.findall(tiercel.metrics.prometheus_text(store))}


def test_dcp_async_save_staging_is_timed(shm_root, disk_root):
    dcp = pytest.importorskip("torch.distributed.checkpoint")
    import tiercel.dcp
    warnings.filterwarnings("ignore", message="torch.distributed is disabled")
    policy = make_policy(shm_root, disk_root)
    try:
        for step in (1, 2):
            w = tiercel.dcp.Writer(policy, step=step)
            dcp.async_save({"w": torch.arange(100_000, dtype=torch.float32) + step}, storage_writer=w).result()
        timing = w.store.metrics().timings["dcp_staging"]
        assert timing["count"] == 2 and 0 < timing["last_seconds"] <= timing["seconds"], timing
        text = timings_in_text(w.store)
        assert text[("tiercel_timing_count_total", "dcp_staging")] == 2, text
        assert text[("tiercel_timing_seconds_total", "dcp_staging")] == pytest.approx(timing["seconds"], abs=1e-8), text
        # Only what ran is counted; the other timings are there, at zero.
        assert text[("tiercel_timing_count_total", "orbax_blocking")] == 0, text
        assert ("tiercel_timing_last_seconds", "orbax_blocking") not in text, text
    finally:
        tiercel.dcp.close()


def orbax_saves(policy: dict[str, Any], directory: str) -> dict[str, Any]:
    """In a fresh interpreter (JAX): three saves through Orbax's CheckpointManager with
    tiercel's handler; the handler's own measure of the last one, and the store's timing."""
    import jax.numpy as jnp
    import orbax.checkpoint as ocp

    import tiercel.orbax

    from orbax_worker import manager

    handler = tiercel.orbax.TiercelCheckpointHandler(policy)
    mngr = manager(handler, directory)
    for step in (1, 2, 3):
        mngr.save(step, args=ocp.args.Composite(state=tiercel.orbax.Save({"w": jnp.arange(1000.0) + step})))
        mngr.wait_until_finished()
    timing = handler.store.metrics().timings["orbax_blocking"]
    return {"timing": timing, "last": handler.last_blocking_seconds, "text": tiercel.metrics.prometheus_text(handler.store)}


def test_an_orbax_save_s_blocking_part_is_timed(shm_root, tmp_path):
    pytest.importorskip("orbax.checkpoint")
    r = run_isolated("test_adapter_timings", "orbax_saves", make_policy(shm_root, None), str(tmp_path / "orbax"), timeout=300)
    timing = r["timing"]
    assert timing["count"] == 3 and timing["last_seconds"] == pytest.approx(r["last"], abs=1e-8), r  # the core keeps whole ns
    assert 'tiercel_timing_count_total{timing="orbax_blocking",rank="0"} 3.0' in r["text"], r["text"]


def test_an_unknown_timing_is_refused_by_name(store):
    with pytest.raises(tiercel.InvalidArgumentError, match="no timing 'dcp_stall' .*known: deepspeed_stall"):
        tiercel.metrics.record(store, "dcp_stall", 1.0)
    tiercel.metrics.record(store, "deepspeed_stall", 0.5)
    assert store.metrics().timings["deepspeed_stall"] == {"count": 1, "seconds": 0.5, "last_seconds": 0.5}
