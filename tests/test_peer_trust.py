"""Who a peer tier trusts, from Python: short secrets are refused wherever they come from,
the secret handed out through a key-value store does not stay there, and an advertised
address is one other hosts can reach. (The wire-level checks -- identities, placement,
strangers, stalls -- are Rust tests in tier/peer/trust_tests.rs.)"""

from __future__ import annotations

import json

import tiercel
from tiercel.advertise import advertised_address, is_loopback

from conftest import error_of, make_policy
from test_multirank import run_ranks


def peer_policy(shm_root, **peer) -> dict:
    pol = make_policy(shm_root, None)
    pol["tier"].append({"name": "peer", "kind": "peer", "listen": "127.0.0.1:0", **peer})
    pol["restore"]["order"].append("peer")
    return pol


def test_an_empty_or_short_secret_is_refused_from_the_environment(shm_root, monkeypatch):
    """Issue 14.11. Repro: TIERCEL_PEER_SECRET="" was accepted (the policy refused `secret =
    ""`); a stranger authenticated with the empty key and pushed a forged replica."""
    for bad in ("", "short"):
        monkeypatch.setenv("TIERCEL_PEER_SECRET", bad)
        msg = error_of(lambda: tiercel.Store(peer_policy(shm_root)), tiercel.ConfigError)
        assert "$TIERCEL_PEER_SECRET" in msg and "at least 16" in msg, msg
    monkeypatch.setenv("TIERCEL_PEER_SECRET", "a-long-enough-secret")
    tiercel.Store(peer_policy(shm_root)).close()


def test_an_empty_or_short_secret_is_refused_in_the_policy(shm_root):
    for bad in ("", "0123456789"):
        msg = error_of(lambda: tiercel.Store(peer_policy(shm_root, secret=bad)), tiercel.ConfigError)
        assert "secret" in msg and ("at least 16" in msg or "non-empty" in msg), msg


KV_WORKER = r"""
import json, os, sys
from datetime import timedelta
import torch.distributed as dist
import tiercel
from tiercel.coordinator import KVStoreCoordinator

policy, out = json.loads(sys.argv[1]), sys.argv[2]
rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
policy["tier"][0]["root"] += f"/rank{rank}"
kv = dist.TCPStore("127.0.0.1", int(os.environ["MASTER_PORT"]), world, rank == 0, timeout=timedelta(seconds=60))
store = tiercel.Store(policy, coordinator=KVStoreCoordinator(kv, rank, world))
assert store.save(1, {"x": [1, 2, 3]}).wait(60)["peer"] == "committed"
KVStoreCoordinator(kv, rank, world, prefix="test-barrier").all_gather(None)
if rank == 0:
    # The rounds under "tiercel/" carried the generated secret: none of their keys may stay.
    left = [k for k in kv.list_keys() if k.startswith("tiercel/")]
    json.dump({"left": left}, open(out, "w"))
KVStoreCoordinator(kv, rank, world, prefix="test-barrier").all_gather(None)
store.close()
"""


def test_the_generated_secret_does_not_stay_in_the_key_value_store(tmp_path, shm_root):
    """Issue 14.12. Repro: the secret rank 0 generated stayed in the TCPStore under
    `tiercel/1/0`, readable by anyone who reaches the store. Every key of the round is
    deleted once every rank has read it."""
    out = tmp_path / "left.json"
    env_of = lambda rank: {"TIERCEL_HOST": f"host{rank}"}  # noqa: E731
    run_ranks(KV_WORKER, [json.dumps(peer_policy(shm_root)), str(out)], tmp_path, 2, env_of, tag="kv")
    assert json.loads(out.read_text()) == {"left": []}


def test_a_wildcard_listen_advertises_the_route_to_the_coordinator(monkeypatch):
    """Issue 13.1: with `listen = "0.0.0.0:7000"` every host advertised 127.0.0.1 (the host
    name maps to loopback in many images). The advertised address is now the interface that
    reaches MASTER_ADDR (as gloo picks its own), TIERCEL_ADVERTISE when set, and an explicit
    listen address as is."""
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    assert advertised_address("0.0.0.0:7000") == "127.0.0.1:7000"
    monkeypatch.setenv("TIERCEL_ADVERTISE", "10.9.8.7")
    assert advertised_address("0.0.0.0:7000") == "10.9.8.7:7000"
    assert advertised_address("192.0.2.1:7000") == "192.0.2.1:7000"
    assert is_loopback("127.0.0.1:1") and is_loopback("[::1]:1") and not is_loopback("10.0.0.1:1")
