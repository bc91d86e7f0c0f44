"""Bit-identical round trips: every dtype and shape, numpy and torch, Python trees, from the
memory tier (zero-copy), from the fs tier alone, and from a new process."""

from __future__ import annotations

import enum
import json
from dataclasses import dataclass, field
from decimal import Decimal

import numpy as np
import pytest
import torch

import tiercel

from conftest import (
    TESTS_DIR,
    allowing_pickle,
    assert_same,
    buffer_base,
    random_numpy,
    random_torch,
    raw_bytes,
    run_python,
    walk_leaves,
)

CHUNK = 64 << 10  # the policy fixture's chunk_size


@dataclass
class Point:
    """Not a tree node: stored as a pickled object."""

    x: int
    label: str
    weights: list[float] = field(default_factory=list)


class Color(enum.Enum):
    RED = 1
    GREEN = 2


NUMPY_DTYPES = [
    np.bool_, np.int8, np.int16, np.int32, np.int64,
    np.uint8, np.uint16, np.uint32, np.uint64,
    np.float16, np.float32, np.float64, np.complex64, np.complex128,
]


def _torch_dtypes() -> list:
    """Every dtype this torch has that tiercel names (uint16/32/64, complex32 and float8
    only where supported)."""
    names = [
        "bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64",
        "float16", "bfloat16", "float32", "float64", "complex32", "complex64", "complex128",
        "float8_e4m3fn", "float8_e5m2",
    ]
    out = []
    for n in names:
        dt = getattr(torch, n, None)
        if not isinstance(dt, torch.dtype):
            continue
        try:
            raw_bytes(random_torch(dt, (2, 3), 0).t())
        except (RuntimeError, TypeError):
            continue
        out.append(dt)
    return out


TORCH_DTYPES = _torch_dtypes()


def big_rows(itemsize: int, cols: int = 33) -> int:
    """Rows of a (rows, cols) array of ~300 KB: several 64 KiB chunks, the last one partial."""
    return 300_000 // (cols * itemsize) + 1


def numpy_cases(dtype, seed: int) -> dict:
    """Every shape and layout of one dtype. Values are expected results (C-order copies
    where the stored value is a view)."""
    it = np.dtype(dtype).itemsize
    big = random_numpy(dtype, (big_rows(it), 33), seed)
    assert big.nbytes > 4 * CHUNK
    return {
        "scalar0d": random_numpy(dtype, (), seed + 1),
        "empty": random_numpy(dtype, (0, 3), seed + 2),
        "one": random_numpy(dtype, (1,), seed + 3),
        "small": random_numpy(dtype, (7, 5), seed + 4),
        "big": big,
        "transposed": big.T,
        "strided": big[::2, 1::3],
        "fortran": np.asfortranarray(big[:100]),
        "offset": big[5:],  # contiguous, not at the start of its buffer
    }


def torch_cases(dtype, seed: int) -> dict:
    it = torch.empty((), dtype=dtype).element_size()
    big = random_torch(dtype, (big_rows(it), 33), seed)
    return {
        "scalar0d": random_torch(dtype, (), seed + 1),
        "empty": random_torch(dtype, (0, 3), seed + 2),
        "one": random_torch(dtype, (1,), seed + 3),
        "small": random_torch(dtype, (7, 5), seed + 4),
        "big": big,
        "transposed": big.t(),
        "strided": big[::2, 1::3],
        "permuted": random_torch(dtype, (4, 6, 5), seed + 5).permute(2, 0, 1),
        "offset": big[5:],
        "expanded": random_torch(dtype, (1, 9), seed + 6).expand(4, 9),
    }


def check_ram_restore(store: tiercel.Store, step: int, want: dict) -> dict:
    """restore() from the memory tier: bit-identical, zero-copy, and private."""
    got = store.restore()
    assert store.last_restore.step == step
    assert_same(got, want)
    n_items = sum(1 for _ in walk_leaves(want))
    assert set(store.last_restore.tiers) == {"ram"}, store.last_restore
    assert sum(store.last_restore.tiers.values()) >= n_items
    for path, arr in walk_leaves(got):
        if isinstance(arr, np.ndarray) and arr.nbytes:
            buf = buffer_base(arr)
            assert buf is not None, f"{path}: not backed by a tiercel Buffer: {arr.base!r}"
            assert buf.kind == "view", f"{path}: from ram yet not a zero-copy view: {buf.kind}"
    return got


def scribble(tree) -> None:
    """Flips bits of every restored array in place."""
    for _, arr in walk_leaves(tree):
        if isinstance(arr, np.ndarray):
            flat = arr.reshape(-1)
            assert arr.size == 0 or np.shares_memory(flat, arr)
            flat.view(np.uint8)[:] ^= 0xA5
        else:
            flat = arr.detach().reshape(-1)
            assert flat.data_ptr() == arr.data_ptr()
            flat.view(torch.uint8).bitwise_xor_(0xA5)


@pytest.mark.parametrize("dtype", NUMPY_DTYPES, ids=lambda d: np.dtype(d).name)
def test_numpy_dtype_roundtrip(store, dtype):
    want = numpy_cases(dtype, seed=11)
    store.save(2, {"arrays": want}).wait(60)
    got = check_ram_restore(store, 2, {"arrays": want})
    for name in ("big", "transposed", "fortran"):
        assert got["arrays"][name].flags.c_contiguous

    # Writing into restored arrays (zero-copy views) never changes the checkpoint.
    scribble(got)
    assert raw_bytes(got["arrays"]["big"]) != raw_bytes(want["big"])
    assert_same(store.restore(), {"arrays": want})

    # The fs tier alone (zstd-compressed chunks).
    r = store.reader(2, tiers=["disk"])
    assert_same(r.get("arrays"), want)
    assert set(r.info.tiers) == {"disk"}


@pytest.mark.parametrize("dtype", TORCH_DTYPES, ids=lambda d: str(d).removeprefix("torch."))
def test_torch_dtype_roundtrip(store, dtype):
    want = torch_cases(dtype, seed=23)
    store.save(4, {"tensors": want}).wait(60)
    got = check_ram_restore(store, 4, {"tensors": want})
    assert all(type(t) is torch.Tensor for t in got["tensors"].values())

    scribble(got)
    assert raw_bytes(got["tensors"]["big"]) != raw_bytes(want["big"])
    assert_same(store.restore(), {"tensors": want})

    r = store.reader(4, tiers=["disk"])
    assert_same(r.get("tensors"), want)
    assert set(r.info.tiers) == {"disk"}


def test_torch_requires_grad_and_lazy_views(store):
    w = torch.randn(300, 100, requires_grad=True)
    z = torch.randn(50, dtype=torch.complex64)
    x = torch.randn(50)
    state = {
        "model": {
            "w": w,
            "frozen": torch.randn(10),
            "grad_view": w[::3],  # a non-contiguous view of a leaf that requires grad
            "conj": z.conj(),  # lazy: same memory as z, conj bit set
            "neg": x._neg_view(),
            "conj_t": z.reshape(5, 10).t().conj(),
        }
    }
    store.save(2, state).wait(60)
    want = {
        "model": {
            "w": w,
            "frozen": state["model"]["frozen"],
            "grad_view": w[::3],
            "conj": z.conj().resolve_conj(),
            "neg": -x,
            "conj_t": z.reshape(5, 10).t().conj().resolve_conj(),
        }
    }
    for got in (store.restore(), store.reader(2, tiers=["disk"]).get_all()):
        assert_same(got["model"]["w"], w)
        assert got["model"]["w"].requires_grad and got["model"]["w"].is_leaf
        assert not got["model"]["frozen"].requires_grad
        assert got["model"]["grad_view"].requires_grad
        for k in ("conj", "neg", "conj_t"):
            g = got["model"][k]
            assert not g.is_conj() and not g.is_neg()
            assert torch.equal(g, want["model"][k]), k
            assert raw_bytes(g) == raw_bytes(want["model"][k]), k


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_cuda_tensors_come_back_on_the_host(store):
    dev = torch.device("cuda")
    state = {
        "model": {
            "w": random_torch(torch.bfloat16, (big_rows(2), 33), 5).to(dev),
            "t": random_torch(torch.float32, (300, 200), 6).to(dev).t(),  # non-contiguous on device
            "g": torch.ones(7, device=dev, requires_grad=True),
            "empty": torch.empty(0, 3, device=dev),
        }
    }
    store.save(2, state).wait(60)
    want = {"model": {k: v.detach().cpu().requires_grad_(v.requires_grad) for k, v in state["model"].items()}}
    for got in (store.restore(), store.reader(2, tiers=["disk"]).get_all()):
        assert_same(got, want)


def test_numpy_scalars_and_byte_order(make_store, policy):
    store = make_store(allowing_pickle(policy))  # numpy str_ and bytes_ scalars are pickled
    state = {
        "scalars": {
            "b": np.bool_(True),
            "i8": np.int8(-7),
            "u64": np.uint64(2**64 - 1),
            "i64": np.int64(-(2**63)),
            "f16": np.float16(-0.0),
            "f32": np.float32("nan"),
            "f64": np.float64("-inf"),
            "c64": np.complex64(1.5 - 2j),
            "c128": np.complex128(complex(float("nan"), -0.0)),
            # These two subclass float and str: they must not come back as Python values.
            "f64_in_list": [np.float64(0.1), 0.1],
            "str_": np.str_("numpy string"),
            "datetime": np.datetime64("2024-02-29T12:00"),
        },
        "zero_d": np.array(3.25),
        "big_endian": np.arange(1000, dtype=">i4"),
        "big_endian_f": np.linspace(0, 1, 77, dtype=">f8"),
    }
    store.save(2, state).wait(60)
    want = dict(state)
    want["big_endian"] = np.arange(1000, dtype=np.int32)
    want["big_endian_f"] = np.linspace(0, 1, 77, dtype=np.float64)
    for got in (store.restore(), store.reader(2, tiers=["disk"]).get_all()):
        assert_same(got, want)
        assert got["big_endian"].dtype.isnative


KEYS_AND_VALUES = {
    "str": "héllo ✓",
    7: 7,
    -0.0: -0.0,
    float("nan"): float("nan"),
    float("inf"): float("-inf"),
    True: False,
    None: None,
    2**70: -(2**70) - 1,
    "big": 2**64 + 1,
    "neg_big": -(2**100),
    "i64_edge": 2**63,
    "float_edges": [5e-324, 1.7976931348623157e308, -0.0, float("nan"), float("inf"), 0.1],
}


def tree_state() -> dict:
    return {
        "tree": {
            "kv": KEYS_AND_VALUES,
            "nested": {"a": [1, (2, [3, {"b": None}]), []], "empty_dict": {}, "empty_tuple": (), "t1": (1,)},
            "list_of_arrays": [np.arange(5), torch.arange(3), (np.ones(2, np.float32), b"x")],
            # Item names come from the path: these must not collide with each other.
            5: np.full(3, 5),
            "5": np.full(3, 6),
            "a/b": np.full(3, 7),
            "a": {"b": np.full(3, 8)},
        },
        "blobs": {
            "bytes": b"\x00\xffabc" * 1000,
            "empty": b"",
            "bytearray": bytearray(b"mutable"),
            "multichunk": bytes(range(256)) * 1000,  # 256 KB: several chunks
        },
        "pickled": {
            "set": {1, 2, 3},
            "frozenset": frozenset({"a"}),
            "point": Point(3, "p", [0.5, float("inf")]),
            "enum": Color.GREEN,
            "complex": complex(1, -2),
            "decimal": Decimal("1.10"),
            "str_array": np.array(["ab", "c"]),
            "datetimes": np.array(["2024-01-01", "2025-06-30"], dtype="datetime64[D]"),
            "objects": np.array([1, "x", None], dtype=object),
        },
    }


def test_python_trees(make_store, policy):
    store = make_store(allowing_pickle(policy))  # the last branch is pickled
    state = tree_state()
    store.save(2, state).wait(60)
    for got in (store.restore(), store.reader(2, tiers=["disk"]).get_all()):
        # assert_same compares pickled objects with ==; numpy arrays among them need help.
        pickled = got["pickled"]
        for k in ("str_array", "datetimes", "objects"):
            assert type(pickled[k]) is np.ndarray and pickled[k].dtype == state["pickled"][k].dtype
            assert pickled[k].tolist() == state["pickled"][k].tolist()
        rest = {k: v for k, v in got.items() if k != "pickled"}
        assert_same(rest, {k: v for k, v in state.items() if k != "pickled"})
        for k in ("set", "frozenset", "point", "enum", "complex", "decimal"):
            assert_same(pickled[k], state["pickled"][k], f"pickled[{k}]")
        assert isinstance(got["blobs"]["bytearray"], bytearray)


def test_writer_puts_and_partial_reads(store):
    model = {"w": np.arange(50_000, dtype=np.float32), "b": torch.ones(10)}
    optim = {"state": {0: {"m": np.full(70_000, 2.0), "step": 12}}, "lr": 1e-3}
    extra = {"rng": b"\x01" * 999, "epoch": 3}
    with store.writer(2) as w:
        w.put("model", model)
        w.put("optim", optim)
        w.put("extra", extra)
    assert w.handle is not None
    assert w.handle.wait(60) == {"ram": "committed", "disk": "committed"}

    for tiers in (None, ["disk"]):
        r = store.reader(2, tiers=tiers)
        assert r.names() == ["model", "optim", "extra"]
        assert_same(r.get("optim"), optim)
        # Only the optim put's one item was read.
        assert r.info.nbytes == optim["state"][0]["m"].nbytes
        assert sum(r.info.tiers.values()) == 1
        assert set(r.info.tiers) == {tiers[0] if tiers else "ram"}
        assert_same(r.get("extra"), extra)
        assert_same(r.get("model"), model)
        with pytest.raises(tiercel.NotFoundError, match="optimizer"):
            r.get("optimizer")
    assert_same(store.restore(), {"model": model, "optim": optim, "extra": extra})


def test_writer_rejects_bad_puts(store):
    with store.writer(3) as w:
        w.put("a", np.ones(3))
        for bad in ("", "a/b", 3):
            with pytest.raises(tiercel.InvalidArgumentError):
                w.put(bad, np.ones(3))
        with pytest.raises(tiercel.InvalidArgumentError, match="already put"):
            w.put("a", np.zeros(3))
    store.flush()
    assert_same(store.restore(3), {"a": np.ones(3)})


def test_odd_steps_stay_in_ram_only(store):
    h = store.save(3, {"x": np.arange(10)})
    assert h.wait(60) == {"ram": "committed", "disk": "not scheduled"}
    assert store.steps() == {"ram": [3], "disk": []}
    with pytest.raises(tiercel.NotFoundError):
        store.reader(3, tiers=["disk"])


# -- across processes ------------------------------------------------------------------------

CHILD_SAVE = r"""
import json, sys
import tiercel
import test_roundtrip as t
policy = json.loads(sys.argv[1])
store = tiercel.Store(policy)
print(json.dumps(store.save(4, t.mixed_state()).wait(60)))
store.close()
"""

CHILD_RESTORE = r"""
import json, sys
import tiercel
import test_roundtrip as t
from conftest import assert_same
policy = json.loads(sys.argv[1])
with tiercel.Store(policy) as store:
    got = store.restore()
    assert_same(got, t.mixed_state())
    print(json.dumps({"step": store.last_restore.step, "tiers": store.last_restore.tiers}))
"""


def mixed_state() -> dict:
    """Deterministic: the same in every process."""
    return {
        "np": {np.dtype(d).name: random_numpy(d, (big_rows(np.dtype(d).itemsize), 33), i) for i, d in enumerate(NUMPY_DTYPES)},
        "torch": {str(d): random_torch(d, (3000,), 100 + i) for i, d in enumerate(TORCH_DTYPES)},
        "grad": torch.linspace(0, 1, 5).requires_grad_(),
        "tree": {"kv": KEYS_AND_VALUES, "point": Point(1, "one", [2.0]), "blob": b"abc" * 10},
        "scalar": np.float32(-0.0),
    }


def test_memory_tier_outlives_the_saving_process(policy, make_store):
    policy = allowing_pickle(policy)  # mixed_state() has a pickled Point
    out = run_python(CHILD_SAVE, json.dumps(policy))
    assert json.loads(out.stdout.strip().splitlines()[-1]) == {"ram": "committed", "disk": "committed"}
    store = make_store(policy)
    assert store.steps() == {"ram": [4], "disk": [4]}
    got = store.restore()
    assert_same(got, mixed_state())
    assert set(store.last_restore.tiers) == {"ram"}
    assert_same(store.reader(4, tiers=["disk"]).get_all(), mixed_state())


def test_restore_in_a_new_process(policy, make_store):
    policy = allowing_pickle(policy)  # mixed_state() has a pickled Point
    store = make_store(policy)
    store.save(4, mixed_state()).wait(60)
    store.close()
    out = run_python(CHILD_RESTORE, json.dumps(policy))
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["step"] == 4 and list(result["tiers"]) == ["ram"], result


def test_children_import_this_module():
    # The child scripts import this file by its module name: keep it importable as such.
    assert (TESTS_DIR / "test_roundtrip.py").exists() and __name__.endswith("test_roundtrip")
