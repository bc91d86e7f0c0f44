"""The leaf registry (tiercel.leaves), the typed manifest, shard info through the Python API,
byte-range reads (`Reader.read`) and the tree's container types."""

from __future__ import annotations

import argparse
import collections
import enum
import pickle
import warnings

import numpy as np
import pytest
import torch

import tiercel
from tiercel import leaves
from tiercel.manifest import Item

from conftest import allowing_pickle, assert_same, chunk_location, error_of, flip_byte


class Meters:
    """A toy framework value: a float32 vector in a wrapper class no built-in handler claims."""

    def __init__(self, values):
        self.values = np.asarray(values, dtype=np.float32)


class MetersHandler(tiercel.LeafHandler):
    framework = "meters"

    def claims(self, value):
        return isinstance(value, Meters)

    def describe(self, value, name):
        arr = value.values
        n = arr.size
        # One piece of a global vector three times as long, as a sharded leaf would be.
        shard = tiercel.Shard(global_shape=(3 * n,), offsets=(n,), replica_id=0)
        return tiercel.Leaf(name, "array", "float32", arr.shape, arr.nbytes, {"framework": self.framework}, arr,
                            shard=shard)

    def host_address(self, leaf):
        return leaf.obj.ctypes.data, leaf.obj

    def rebuild(self, item, buf):
        return Meters(np.frombuffer(buf, dtype=np.float32).reshape(item.shape))


@pytest.fixture
def meters_handler():
    h = MetersHandler()
    tiercel.register_leaf_handler(h)
    yield h
    leaves._handlers[:] = [x for x in leaves._handlers if x is not h]


def test_registered_handler_round_trips_with_its_shard(store, meters_handler):
    store.save(2, {"m": {"speed": Meters(np.arange(1000)), "plain": np.ones(3)}}).wait(60)
    r = store.reader(2)
    item = r.manifest.item("m/speed")
    assert isinstance(item, Item) and item.framework == "meters"
    assert item.shard == tiercel.Shard((3000,), (1000,), 0)
    assert r.manifest.item("m/plain").shard is None
    back = r.get("m")
    assert isinstance(back["speed"], Meters) and np.array_equal(back["speed"].values, np.arange(1000, dtype=np.float32))
    # A process that has not registered the handler is told what to import, by item name.
    leaves._handlers[:] = [x for x in leaves._handlers if x is not meters_handler]
    with pytest.raises(tiercel.InvalidArgumentError, match="'m/speed'.*'meters' leaf handler"):
        store.reader(2).get("m")


def test_typed_manifest_describes_every_put(store):
    store.save(4, {"model": {"w": torch.arange(12, dtype=torch.bfloat16).reshape(3, 4)}, "optim": {"b": b"xyz"}}).wait(60)
    m = store.reader(4).manifest
    assert (m.step, m.rank, m.world_size, m.tier) == (4, 0, 1, "ram")
    assert m.puts() == ["model", "optim"]
    (w,) = m.items_of("model")
    assert (w.name, w.dtype, w.shape, w.nbytes, w.framework, w.index) == ("model/w", "bfloat16", (3, 4), 24, "torch", 0)
    (b,) = m.items_of("optim")
    assert (b.kind, b.framework, b.index) == ("bytes", "bytes", 1)
    assert m.raw_bytes == 27 and sum(len(it.chunks) for it in m.items) == 2


def test_read_returns_byte_ranges_and_verifies_them(policy, store):
    a = np.arange(300_000, dtype=np.int32)  # 1.2 MB: several 64 KiB chunks
    store.save(2, {"model": {"a": a}}).wait(60)
    r = store.reader(2)
    raw = a.view(np.uint8)
    assert np.array_equal(r.read("model/a", 100_000, 70_000), raw[100_000:170_000])
    assert np.array_equal(r.read(0), raw)
    assert r.read(r.manifest.items[0], 5, 0).size == 0
    with pytest.raises(tiercel.InvalidArgumentError, match="outside its 1200000 bytes"):
        r.read("model/a", 1_199_999, 2)
    with pytest.raises(tiercel.NotFoundError, match="no item 'nope'"):
        r.read("nope")
    # A bad chunk on the memory tier inside the range is read from disk instead; one outside
    # the range is never touched.
    path, off, _ = chunk_location(policy["tier"][0]["root"], 2, "model/a", chunk=3)
    flip_byte(path, off + 10)
    r = store.reader(2)
    assert np.array_equal(r.read("model/a", 0, 65536), raw[:65536])
    assert r.info.tiers == {"ram": 1}
    got = r.read("model/a", 3 * 65536, 100)
    assert np.array_equal(got, raw[3 * 65536:3 * 65536 + 100])
    assert "disk" in r.info.tiers and any("chunk 3" in w for w in r.info.warnings)


Point = collections.namedtuple("Point", "x y")


class Color(enum.IntEnum):
    RED = 1


def test_container_types_are_kept(make_store):
    state = {
        "sd": collections.OrderedDict([("b", torch.ones(2)), ("a", torch.zeros(2))]),
        "p": Point(np.ones(2), 3),
        "size": torch.Size([4, 5]),
        "color": Color.RED,
    }
    store = make_store()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # none of these is pickled (the enum neither, by value and class)
        store.save(2, {"state": state}).wait(60)
    back = store.restore()["state"]
    assert type(back["sd"]) is collections.OrderedDict and list(back["sd"]) == ["b", "a"]
    assert type(back["p"]) is Point and back["p"].y == 3 and np.array_equal(back["p"].x, np.ones(2))
    assert type(back["size"]) is torch.Size and back["size"] == torch.Size([4, 5])
    assert back["color"] is Color.RED
    m = store.reader(2).manifest
    assert [it.framework for it in m.items] == ["torch", "torch", "numpy"]


def test_a_state_dict_keeps_its_module_versions(store):
    # torch's state_dict() carries `_metadata` (module versions), which load_state_dict reads
    # and torch.save keeps: DeepSpeed's exported checkpoints must have it too.
    sd = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.BatchNorm1d(2)).state_dict()
    store.save(2, {"sd": sd}).wait(60)
    for back in (store.restore()["sd"], store.reader(2, tiers=["disk"]).get("sd")):
        assert type(back) is collections.OrderedDict and list(back) == list(sd)
        assert back._metadata == sd._metadata and back._metadata["1"]["version"] == 2
        assert all(torch.equal(back[k], sd[k]) for k in sd)


def test_bad_values_are_invalid_arguments_naming_the_path(store):
    loop: dict = {"a": 1}
    loop["self"] = loop
    with pytest.raises(tiercel.InvalidArgumentError, match="'x/self' contains itself"):
        store.save(2, {"x": loop})
    with pytest.raises(tiercel.InvalidArgumentError, match="'x/m' is a numpy masked array"):
        store.save(2, {"x": {"m": np.ma.masked_array([1, 2], mask=[0, 1])}})
    with pytest.raises(tiercel.InvalidArgumentError, match="'x/f'.*cannot be stored.*pickling it failed"):
        store.save(2, {"x": {"f": lambda: 0}})
    store.save(2, {"x": {"ok": np.ones(2)}}).wait(60)
    assert_same(store.restore(), {"x": {"ok": np.ones(2)}})


def test_steps_and_depth_are_checked_at_the_call(store):
    for bad in (-1, "x", 1.0, True):
        with pytest.raises(tiercel.InvalidArgumentError, match="a step is a non-negative int"):
            store.restore(bad)
        with pytest.raises(tiercel.InvalidArgumentError, match="a step is a non-negative int"):
            store.save(bad, {"a": 1})
    deep: list = [np.ones(1)]
    for _ in range(60):
        deep = [deep]
    with pytest.raises(tiercel.InvalidArgumentError, match="nested more than 48 levels"):
        store.save(2, {"deep": deep})
    ok: list = [np.ones(1)]
    for _ in range(47):
        ok = [ok]
    store.save(2, {"ok": ok}).wait(60)
    assert_same(store.restore(2), {"ok": ok})
def test_exceptions_pickle_and_live_in_tiercel(store):
    try:
        store.reader(99)
    except tiercel.NotFoundError as e:
        err = e
    assert type(err).__module__ == "tiercel"
    again = pickle.loads(pickle.dumps(err))
    assert type(again) is tiercel.NotFoundError and str(again) == str(err)


def test_pickle_policy_warns_forbids_or_allows(make_store, policy):
    state = {"x": {"w": np.ones(4), "args": argparse.Namespace(lr=0.5)}}  # a Namespace only pickle stores
    warn = make_store()  # the default: "warn"
    # The default's restores refuse to unpickle, so its saves refuse what only pickle stores,
    # naming the put, the path and the type (issue 28: it used to be saved, then refused at restore).
    msg = error_of(lambda: warn.save(2, state), tiercel.InvalidArgumentError)
    assert msg.startswith("step 2: 'x/args' (put 'x', path 'args'): argparse.Namespace can only be stored by pickling "
                          'it, and restores refuse to unpickle under [store] pickle = "warn" (the default)'), msg
    assert warn.steps()["ram"] == []
    # An adapter whose reader unpickles its own objects (DeepSpeed) may pickle under "warn".
    with pytest.warns(leaves.PickleWarning, match="'x/args' .*argparse.Namespace is stored by pickling it"):
        with warn.writer(2) as w:
            w.write(w.prepare("x", state["x"], trust_pickles=True))
    assert_same(tiercel.Reader(warn, 2, trust_pickles=True).get("x"), state["x"])
    # Everyone else's restores refuse to run the checkpoint's code, before reading anything;
    # the bytes stay readable.
    with pytest.raises(tiercel.InvalidArgumentError) as refused:
        warn.restore()
    msg = str(refused.value)
    assert "step 2 rank 0 item 'x/args' is a pickled Namespace" in msg and 'pickle = "allow"' in msg
    assert (refused.value.step, refused.value.rank, refused.value.item) == (2, 0, "x/args")
    r = warn.reader(2)
    error_of(lambda: r.value("x/args"), tiercel.InvalidArgumentError)
    assert r.info.nbytes == 0
    assert r.read("x/args").tobytes() == pickle.dumps(state["x"]["args"], protocol=pickle.HIGHEST_PROTOCOL)
    warn.close()

    forbid = make_store({**policy, "store": {**policy["store"], "pickle": "error"}})
    for trust in (False, True):  # "error": nothing is pickled, whoever reads it
        msg = error_of(lambda: forbid.writer(4).prepare("x", state["x"], trust_pickles=trust), tiercel.InvalidArgumentError)
        assert msg.startswith("step 4: 'x/args' (put 'x', path 'args'): argparse.Namespace can only be stored by "
                              "pickling it, which the policy forbids"), msg
    assert forbid.steps()["ram"] == [2]  # nothing of step 4 was kept
    forbid.close()

    allow = make_store(allowing_pickle(policy))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no warning at all
        allow.save(6, state).wait(60)
    assert_same(allow.restore(), state)
    assert_same(allow.restore(step=2), state)  # a step saved under another setting: the reader's policy decides
    msg = error_of(lambda: make_store({**policy, "store": {"pickle": "sometimes"}}), tiercel.ConfigError)
    assert msg == '<dict>: store.pickle: expected "warn" (the default), "error" or "allow", got "sometimes"'
