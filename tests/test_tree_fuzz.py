"""Fixed-time fuzzing of the tree decoder (tiercel._tree via Manifest.from_json), like the
core's targets in rust/tiercel-core/src/fuzz_tests.rs: `$TIERCEL_FUZZ_SECS` seconds per
target (default 2; `make chaos` runs 60). The trees in a manifest are opaque to the core,
which checks the manifest's checksum and JSON only; a tree whose checksum was recomputed over
damage, or a manifest written by hand, reaches the decoder as is. Every input must decode,
or raise a TiercelError naming step, rank, put and where in the tree: never a KeyError,
TypeError, ValueError or RecursionError.

Repro (before the decoder checked trees): `{"t": "dict", "v": [[{"t": "str", "v": "w"}]]}`
(a pair without its value) gave `ValueError: not enough values to unpack`, `{"t": "item"}` a
KeyError, and `{"t": "item", "i": 5}` in a put of one item a KeyError at restore."""

from __future__ import annotations

import copy
import dataclasses
import datetime as dt
import enum
import json
import os
import pathlib
import random
import time
from collections import OrderedDict, namedtuple
from typing import Any

import pytest

from tiercel import TiercelError
from tiercel._tree import flatten, unflatten
from tiercel.manifest import Manifest

Point = namedtuple("Point", "x y")


class Mode(enum.Enum):
    A = 1
    B = (2, "b")


@dataclasses.dataclass
class Cfg:
    lr: float
    tags: Any


def _budget() -> float:
    return float(os.environ.get("TIERCEL_FUZZ_SECS", "2"))


def sample_manifest() -> dict:
    """A manifest (as parsed JSON) of three puts whose trees use every node kind."""
    od: OrderedDict = OrderedDict(a=1, b=[2.5, None])
    od._metadata = {"": {"version": 1}}  # type: ignore[attr-defined]
    states = {
        "model": {"w": b"x", 1: "one", 2.5: True, None: [1, (2, 3)], "od": od, "p": Point(b"y", 7), "big": 2**80},
        "optim": [float("nan"), float("-inf"), "text", (b"z",)],
        # The plain types of tiercel._plain and the set/enum/dataclass/namedtuple nodes.
        "plain": {"s": {1, 2}, "f": frozenset({"a", (1, b"q")}), "c": complex(1.5, float("nan")), "e": [Mode.A, Mode.B],
                  "d": Cfg(0.1, {frozenset()}), "when": dt.datetime(2026, 1, 2, 3, 4, 5, 6, tzinfo=dt.timezone.utc),
                  "day": dt.date(2026, 1, 2), "at": dt.time(1, 2, fold=1), "dur": dt.timedelta(-1, 2, 3),
                  "path": pathlib.PurePosixPath("a/b"), "win": pathlib.PureWindowsPath("c:/x")},
    }
    trees, items = [], []
    for name, value in states.items():
        tree, leaves = flatten(name, value)
        trees.append([name, tree])
        items += [{"name": leaf.name, "kind": "bytes", "dtype": "uint8", "shape": [0], "nbytes": 0, "chunks": []} for leaf in leaves]
    return {"format": "tiercel-manifest", "version": 1, "step": 7, "rank": 0, "world_size": 1, "tier": "ram",
            "chunk_size": 65536, "objects": [], "trees": trees, "items": items}


JUNK: list[Any] = [None, True, 0, -1, 2**70, 1.5, "", "x", "OrderedDict", "collections:OrderedDict", "builtins:int",
                   ":", "os:system", [], {}, [[]], {"t": "item"}, {"t": "item", "i": 99}, {"t": "item", "i": True},
                   {"t": "int", "v": "1" * 5000}, {"t": "int", "v": "zz"}, {"t": "float", "v": "nan?"}, {"t": "nope"},
                   {"t": "dict", "v": [[{"t": "str", "v": "w"}]]}, {"t": "dict", "v": 3}, {"t": "tuple", "v": [], "c": 5},
                   {"t": "dict", "v": [], "a": {"t": "dict", "v": [[{"t": "str", "v": "__class__"}, {"t": "none"}]]},
                    "c": "OrderedDict"},
                   # The kinds added after format version 1 shipped.
                   {"t": "set", "v": [{"t": "list", "v": []}]}, {"t": "enum", "c": "os:system", "v": {"t": "none"}},
                   {"t": "enum", "c": "test_tree_fuzz:Mode", "v": {"t": "int", "v": "9"}}, {"t": "enum"},
                   {"t": "dataclass", "c": "test_tree_fuzz:Point", "v": []}, {"t": "dataclass", "c": "test_tree_fuzz:Cfg", "v": [["lr", {"t": "none"}]]},
                   {"t": "namedtuple", "c": "test_tree_fuzz:Point", "v": [["x", {"t": "none"}], ["x", {"t": "none"}]]},
                   {"t": "namedtuple", "c": "test_tree_fuzz:Cfg", "v": []}, {"t": "complex", "v": ["nan:00", "1"]},
                   {"t": "complex", "v": ["nan:7ff0000000000000", "0x1p+0"]}, {"t": "datetime", "v": "2026-13-01T00:00:00"},
                   {"t": "datetime", "v": "2026-01-01T00:00:00", "z": {"o": 86_400_000_000}}, {"t": "time", "v": "1:2", "z": {"zone": "No/Where"}},
                   {"t": "timedelta", "v": [10**12, 0, 0]}, {"t": "date", "v": 5}, {"t": "path", "c": "WindowsPath", "v": "c:/x"},
                   {"t": "path", "c": "os", "v": "x"}, ["lr"], [3, {"t": "none"}]]


def nodes(x: Any, out: list) -> list:
    """Every container (dict or list) inside a parsed tree, to mutate in place."""
    if isinstance(x, (dict, list)):
        out.append(x)
        for v in (x.values() if isinstance(x, dict) else x):
            nodes(v, out)
    return out


def mutate_structure(rng: random.Random, m: dict) -> dict:
    """Random edits inside the trees (the (name, tree) pairs around them are the core's
    schema, checked before Python sees a manifest)."""
    m = copy.deepcopy(m)
    for _ in range(1 + rng.randrange(3)):
        inside = [n for _, tree in m["trees"] for n in nodes(tree, [])]
        target = rng.choice(inside)
        if isinstance(target, dict) and target:
            key = rng.choice([*target, "t", "v", "i", "c", "a"])
            match rng.randrange(4):
                case 0:
                    target.pop(key, None)
                case 1:
                    target[key] = copy.deepcopy(rng.choice(JUNK))
                case 2:
                    target[key] = copy.deepcopy(rng.choice(inside))
                case _:
                    target["t"] = rng.choice(["none", "bool", "int", "float", "str", "item", "dict", "list", "tuple", 3,
                                              "set", "frozenset", "enum", "dataclass", "namedtuple", "complex",
                                              "datetime", "date", "time", "timedelta", "path"])
        elif isinstance(target, list):
            match rng.randrange(3):
                case 0 if target:
                    target.pop(rng.randrange(len(target)))
                case 1:
                    target.insert(rng.randrange(len(target) + 1), copy.deepcopy(rng.choice(JUNK)))
                case _:
                    target.append(copy.deepcopy(target))
    return m


def mutate_bytes(rng: random.Random, m: dict) -> bytes:
    """The trees' JSON with random byte edits (the rest of a manifest the core has checked
    against its schema before Python sees it)."""
    raw = bytearray(json.dumps(m["trees"]).encode())
    for _ in range(1 + rng.randrange(4)):
        at = rng.randrange(len(raw))
        match rng.randrange(3):
            case 0:
                raw[at] ^= 1 << rng.randrange(8)
            case 1:
                raw[at:at] = rng.choice([b"[", b"]", b"{}", b'"i":3,', b'"t":"item",', b"null", b"-1"])
            case _:
                del raw[at:at + rng.randrange(1, 8)]
    return bytes(raw)


def decode(text: str | bytes) -> None:
    """What a restore does with a manifest's trees: parse, then rebuild each put."""
    m = Manifest.from_json(text)
    for put in m.puts():
        unflatten(m.trees[put], [object()] * len(m.items_of(put)), f"step {m.step} rank {m.rank} put '{put}'")


@pytest.mark.parametrize("target", ["structure", "bytes"])
def test_tree_decoder_fuzz(target):
    seed = int(os.environ.get("TIERCEL_FUZZ_SEED", "1"))
    rng = random.Random(seed)
    base = sample_manifest()
    decode(json.dumps(base))  # the unmutated manifest decodes
    t0, n, refused = time.monotonic(), 0, 0
    while time.monotonic() - t0 < _budget():
        if target == "structure":
            text = json.dumps(mutate_structure(rng, base))
        else:
            try:
                trees = json.loads(mutate_bytes(rng, base))
            except ValueError:
                continue  # the core refuses a manifest that is not JSON before Python sees it
            if not (isinstance(trees, list) and all(isinstance(t, list) and len(t) == 2 and isinstance(t[0], str) for t in trees)):
                continue  # nor one whose trees are not (name, tree) pairs (its schema)
            text = json.dumps({**base, "trees": trees})
        try:
            decode(text)
        except TiercelError as e:
            assert "step 7 rank 0" in str(e), (n, seed, str(e))
            refused += 1
        except Exception as e:
            pytest.fail(f"input {n} (seed {seed}) raised {type(e).__name__}: {e}\n{text[:2000]}")
        n += 1
    print(f"fuzz tree {target}: {n} inputs ({refused} refused) in {time.monotonic() - t0:.1f} s (seed {seed})")
    assert n > 100 and refused > 0, (n, refused)
