"""Common plain Python types round trip without pickle (issue 28, item 3), and a value that
only pickle could store is refused at save when the restore would refuse it.

Repro (before): with `[store] pickle` at its default, `save(2, {"extra": {"seen": {1, 2}}})`
succeeded with a PickleWarning and `restore()` then refused the whole step ("item
'extra/seen' is a pickled set ... refused"); sets, complex numbers, datetimes, paths, enums
and dataclasses were all pickled."""

from __future__ import annotations

import argparse
import collections
import dataclasses
import datetime as dt
import enum
import json
import math
import pathlib
import struct
import sys
import textwrap
import typing
import warnings
import zoneinfo
from typing import Any

import numpy as np
import pytest
import torch

import tiercel
import tiercel.torch
from tiercel._tree import check_tree, flatten, unflatten

from conftest import allowing_pickle, assert_same, error_of, manifest_path, run_python


class Mode(enum.Enum):
    TRAIN = "train"
    EVAL = "eval"


class Level(enum.IntEnum):
    LOW = 1
    HIGH = 2


class Perm(enum.Flag):
    R = 4
    W = 2
    X = 1


class Pair(enum.Enum):
    A = (1, "a")  # a tuple value: the enum must not be taken for a tuple


class Color(enum.StrEnum):
    RED = "red"


@dataclasses.dataclass
class Opt:
    lr: float
    betas: tuple[float, float]
    weights: torch.Tensor
    tags: set[str] = dataclasses.field(default_factory=set)
    mode: Mode = Mode.TRAIN


@dataclasses.dataclass(frozen=True)
class Frozen:
    when: dt.datetime
    where: pathlib.Path


@dataclasses.dataclass(slots=True)
class Slotted:
    a: int
    b: Any = None


@dataclasses.dataclass
class Doubled:
    """__post_init__ changes the value: a restore must not run it again."""

    n: int
    seen: int = dataclasses.field(init=False, default=0)

    def __post_init__(self):
        self.n *= 2


Point = collections.namedtuple("Point", "x y")


class Sample(typing.NamedTuple):
    index: int
    label: str = "none"


BERLIN = zoneinfo.ZoneInfo("Europe/Berlin")


def plain_state() -> dict:
    """Every type of the item, nested in dicts and lists beside tensors and arrays."""
    doubled = Doubled(3)
    doubled.seen = 5
    return {
        "sets": {"ints": {3, 1, 2}, "strs": {"b", "a"}, "empty": set(), "frozen": frozenset({(1, 2), (3, 4)}),
                 "nested": {frozenset({1}), frozenset()}, "mixed": {1, "x", None, (2.5, b"k")},
                 "enums": {Mode.TRAIN, Level.HIGH}},
        "complex": [complex(1.5, -0.0), complex(float("nan"), float("-inf")), 0j, complex(1e-320, 2**60)],
        "times": {
            "naive": dt.datetime(2026, 12, 3, 19, 4, 5, 123456),
            "no_us": dt.datetime(2026, 1, 1),
            "utc": dt.datetime(2026, 12, 3, 19, 4, 5, 1, tzinfo=dt.timezone.utc),
            "offset": dt.datetime(1999, 12, 31, 23, 59, 59, 999999, tzinfo=dt.timezone(dt.timedelta(hours=5, minutes=30))),
            "named": dt.datetime(2026, 6, 1, tzinfo=dt.timezone(dt.timedelta(hours=-7, seconds=1, microseconds=3), "PDT?")),
            "zone": dt.datetime(2026, 10, 25, 2, 30, tzinfo=BERLIN, fold=1),  # the second 02:30 of that night
            "zone0": dt.datetime(2026, 10, 25, 2, 30, tzinfo=BERLIN),
            "min": dt.datetime.min, "max": dt.datetime.max,
            "date": dt.date(1, 1, 1), "today": dt.date(2026, 12, 3),
            "time": dt.time(23, 59, 59, 999999), "time_tz": dt.time(1, 2, tzinfo=dt.timezone.utc), "midnight": dt.time(),
            "deltas": [dt.timedelta(days=-3, microseconds=7), dt.timedelta.max, dt.timedelta.min, dt.timedelta()],
        },
        "paths": [pathlib.Path("runs/a"), pathlib.Path("/abs/x.pt"), pathlib.PurePosixPath("p/q"),
                  pathlib.PureWindowsPath(r"C:\ckpt\run 1"), pathlib.PurePath("rel")],
        "enums": [Mode.EVAL, Level.LOW, Perm.R | Perm.W, Perm(0), Pair.A, Color.RED],
        "dataclasses": {"opt": Opt(1e-3, (0.9, 0.999), torch.arange(4.0), {"x"}),
                        "frozen": Frozen(dt.datetime(2026, 1, 2, tzinfo=dt.timezone.utc), pathlib.Path("w")),
                        "slotted": Slotted(1, Slotted(2, np.arange(3))), "doubled": doubled},
        "tuples": [Point(torch.ones(2), {"k": Point(1, 2)}), Sample(7), Sample(8, "cat"), torch.Size([2, 3])],
        "tensor": torch.arange(6, dtype=torch.int16), "array": np.linspace(0, 1, 5),
    }


def same(got: Any, want: Any, path: str = "$") -> None:
    """Equal and of the same type, all the way down; floats bit for bit, aware datetimes
    with the same tzinfo (class and offset) and fold, arrays and tensors by assert_same."""
    assert type(got) is type(want), f"{path}: got {type(got).__name__} {got!r:.80}, want {type(want).__name__}"
    if isinstance(want, (torch.Tensor, np.ndarray, np.generic, dict, float)) or type(want) in (list, tuple):
        if isinstance(want, dict):
            assert list(got) == list(want), path
            for k in want:
                same(got[k], want[k], f"{path}[{k!r}]")
        elif type(want) in (list, tuple):
            assert len(got) == len(want), path
            for i, (g, w) in enumerate(zip(got, want)):
                same(g, w, f"{path}[{i}]")
        else:
            assert_same(got, want, path)
    elif isinstance(want, complex):
        assert struct.pack("<dd", got.real, got.imag) == struct.pack("<dd", want.real, want.imag), f"{path}: {got!r}"
    elif isinstance(want, (set, frozenset)):
        assert got == want, f"{path}: {got!r} != {want!r}"
        assert sorted(map(repr, map(type, got))) == sorted(map(repr, map(type, want))), path
    elif isinstance(want, enum.Enum):
        assert got is want, f"{path}: {got!r} is not {want!r}"
    elif dataclasses.is_dataclass(want):
        for f in dataclasses.fields(want):
            same(getattr(got, f.name), getattr(want, f.name), f"{path}.{f.name}")
    elif isinstance(want, tuple):  # named tuples, torch.Size
        for i, (g, w) in enumerate(zip(got, want, strict=True)):
            same(g, w, f"{path}[{i}]")
    elif isinstance(want, (dt.datetime, dt.time)):
        assert got == want and got.fold == want.fold and type(got.tzinfo) is type(want.tzinfo), f"{path}: {got!r}"
        assert got.isoformat() == want.isoformat() and got.tzname() == want.tzname(), f"{path}: {got!r} != {want!r}"
    else:
        assert got == want, f"{path}: {got!r:.200} != {want!r:.200}"


def test_plain_types_stay_in_the_tree_and_round_trip(make_store, policy):
    state = plain_state()
    store = make_store()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no PickleWarning, nothing pickled
        store.save(2, {"extra": state}).wait(60)
    m = store.reader(2).manifest
    assert {it.framework for it in m.items} == {"torch", "numpy", "bytes"}, [(it.name, it.framework) for it in m.items]
    assert "extra/dataclasses/opt/weights" in [it.name for it in m.items]
    same(store.restore()["extra"], state)  # from the memory tier, under the default policy
    assert store.last_restore.tiers == {"ram": len(m.items)}
    same(store.reader(2, tiers=["disk"]).get("extra"), state)
    store.close()

    # From the fs tier, in a new process (classes imported by their names there).
    p = run_python(textwrap.dedent("""
        import json, sys, tiercel, test_plain_types as t
        with tiercel.Store(json.loads(sys.argv[1]), rank=0, world_size=1) as s:
            r = s.reader(2, tiers=["disk"])
            t.same(r.get("extra"), t.plain_state())
            print("same", r.info.tiers)
    """), json.dumps(policy))
    assert p.stdout.startswith("same {'disk':"), p.stdout


def test_torch_save_state_extra_keeps_plain_types(make_store):
    store = make_store()
    model = torch.nn.Linear(2, 2)
    extra = {"epoch": 3, "started": dt.datetime(2026, 12, 3, 8, 0, tzinfo=dt.timezone.utc), "seen": {1, 5},
             "out": pathlib.Path("runs/x"), "mode": Mode.EVAL, "opt": Opt(0.1, (0.9, 0.99), torch.zeros(1))}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        tiercel.torch.save_state(store, 2, model=model, extra=extra).wait(60)
    back: dict = {}
    assert tiercel.torch.load_state(store, model=torch.nn.Linear(2, 2), extra=back) == 2
    same(back, extra)


class Local:
    pass


def test_a_value_only_pickle_stores_is_refused_at_save(make_store, policy):
    store = make_store()  # [store] pickle at its default: restores refuse to unpickle
    store.save(2, {"x": {"ok": 1}}).wait(60)
    cases = [
        ({"cfg": {"args": argparse.Namespace(lr=0.1)}}, "path 'cfg/args'", "argparse.Namespace"),
        ({"counts": collections.Counter("aab")}, "path 'counts'", "collections.Counter"),
        ({"t": [dt.datetime(2026, 1, 1, tzinfo=zoneinfo.ZoneInfo.no_cache("UTC"))]}, "path 't/0'", "datetime.datetime"),
        ({"obj": Local()}, "path 'obj'", "test_plain_types.Local"),
    ]
    for value, path, type_name in cases:
        msg = error_of(lambda: store.save(4, {"extra": value}), tiercel.InvalidArgumentError)
        assert msg.startswith(f"step 4: 'extra/{path[6:-1]}' (put 'extra', {path}): {type_name} can only be stored by "
                              "pickling it, and restores refuse to unpickle"), msg
        assert 'pickle = "allow"' in msg and "What can be stored" in msg, msg
    # tiercel.torch.save_state's extra= too, and nothing of the refused steps was kept.
    msg = error_of(lambda: tiercel.torch.save_state(store, 4, model=torch.nn.Linear(1, 1),
                                                    extra={"args": argparse.Namespace(a=1)}), tiercel.InvalidArgumentError)
    assert "(put 'extra', path 'args'): argparse.Namespace" in msg, msg
    assert store.steps()["ram"] == [2]

    # Classes a restore could not import by name: said at save, with what to do.
    @dataclasses.dataclass
    class Inner:
        a: int

    Loose = enum.Enum("Loose", "A B")  # its module is not this one's: not importable by name
    for value, what in ((Inner(1), "Inner"), (Loose.A, "Loose"), (collections.namedtuple("P", "a")(1), "P")):
        msg = error_of(lambda: store.save(4, {"extra": {"v": value}}), tiercel.InvalidArgumentError)
        assert "(put 'extra', path 'v')" in msg and what in msg and "define it at module level" in msg, msg

    # Under "allow", such values are pickled and restored (the policy trusts its checkpoints).
    allow = make_store(allowing_pickle(policy))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        allow.save(6, {"extra": {"args": argparse.Namespace(lr=0.1), "when": dt.date(2026, 1, 1)}}).wait(60)
    back = allow.restore()["extra"]
    assert back["args"] == argparse.Namespace(lr=0.1) and back["when"] == dt.date(2026, 1, 1)
    assert [it.name for it in allow.reader(6).manifest.items] == ["extra/args"]


def test_a_class_that_changed_or_went_missing_fails_the_restore_naming_it(make_store, policy, tmp_path):
    # The classes live in a module written for this test; the restoring process has another.
    mod = tmp_path / "mod"
    mod.mkdir()
    (mod / "trainstate.py").write_text(textwrap.dedent("""
        import dataclasses, enum
        class Phase(enum.Enum):
            WARMUP = 1
            MAIN = 2
        @dataclasses.dataclass
        class Cfg:
            lr: float
            depth: int
    """))
    sys.path.insert(0, str(mod))
    try:
        import trainstate

        store = make_store()
        store.save(2, {"extra": {"phase": trainstate.Phase.MAIN, "cfg": [trainstate.Cfg(0.1, 3)]}}).wait(60)
        same(store.restore()["extra"], {"phase": trainstate.Phase.MAIN, "cfg": [trainstate.Cfg(0.1, 3)]})
        store.close()
    finally:
        sys.path.remove(str(mod))
        sys.modules.pop("trainstate", None)
    code = textwrap.dedent("""
        import json, sys, tiercel
        sys.path[1:1] = sys.argv[2:]  # where the classes' module is, if anywhere
        with tiercel.Store(json.loads(sys.argv[1]), rank=0, world_size=1) as s:
            try:
                s.restore()
            except tiercel.TiercelError as e:
                print(type(e).__name__, e.step, e.rank, "|", e)
    """)
    # The module is gone: the enum cannot be imported.
    out = run_python(code, json.dumps(policy)).stdout
    assert out.startswith("InvalidArgumentError 2 0 | step 2 rank 0 put 'extra' at 'phase': trainstate.Phase cannot be "
                          "imported here (module 'trainstate': ModuleNotFoundError"), out
    # The module is there, but the dataclass lost a field and the enum a member.
    (mod / "trainstate.py").write_text(textwrap.dedent("""
        import dataclasses, enum
        class Phase(enum.Enum):
            MAIN = 2
        @dataclasses.dataclass
        class Cfg:
            lr: float
    """))
    out = run_python(code, json.dumps(policy), str(mod)).stdout
    assert out.startswith("InvalidArgumentError 2 0 | step 2 rank 0 put 'extra' at 'cfg/0': dataclass trainstate.Cfg "
                          "has the fields ['lr'] here, the checkpoint ['lr', 'depth']; the code changed"), out
    (mod / "trainstate.py").write_text("import enum\nclass Phase(enum.Enum):\n    WARMUP = 1\nclass Cfg: pass\n")
    out = run_python(code, json.dumps(policy), str(mod)).stdout
    assert out.startswith("InvalidArgumentError 2 0 | step 2 rank 0 put 'extra' at 'phase': enum trainstate.Phase has no "
                          "member of value 2 here"), out


OLD_TREE = {  # as format version 1 has written them since it shipped, and still does
    "t": "dict", "v": [
        [{"t": "str", "v": "p"}, {"t": "tuple", "v": [{"t": "int", "v": "1"}, {"t": "item", "i": 0}],
                                  "c": "test_plain_types:Point"}],
        [{"t": "str", "v": "gone"}, {"t": "tuple", "v": [{"t": "int", "v": "1"}], "c": "no_such_module:Gone"}],
        [{"t": "str", "v": "size"}, {"t": "tuple", "v": [{"t": "int", "v": "2"}], "c": "torch:Size"}],
        [{"t": "int", "v": "3"}, {"t": "list", "v": [{"t": "float", "v": "0x1.8p+0"}, {"t": "none"}]}],
    ]}


def test_old_trees_read_as_before_and_new_kinds_are_named_to_old_readers():
    assert check_tree(OLD_TREE, "step 1 rank 0 put 'x'") == [0]
    got = unflatten(OLD_TREE, ["leaf"])
    same(got, {"p": Point(1, "leaf"), "gone": (1,), "size": torch.Size([2]), 3: [1.5, None]})
    # A named tuple is now written as its fields (a new kind); an old one still reads.
    tree, _ = flatten("x", {"p": Point(1, 2)})
    assert tree["v"][0][1] == {"t": "namedtuple", "c": "test_plain_types:Point",
                               "v": [["x", {"t": "int", "v": "1"}], ["y", {"t": "int", "v": "2"}]]}
    # A node kind this reader does not know (a newer tiercel's) is refused by name.
    future = {"t": "dict", "v": [[{"t": "str", "v": "a"}, {"t": "hologram", "v": []}]]}
    msg = error_of(lambda: check_tree(future, "step 1 rank 0 put 'x'"), tiercel.IntegrityError)
    assert msg == ("step 1 rank 0 put 'x': the tree at '/a' is a 'hologram' node, which this tiercel does not know: "
                   "the step was written by a newer tiercel (upgrade this one), or the manifest is damaged")


def test_a_pickled_step_of_the_old_default_still_restores_where_allowed(make_store, policy, shm_root):
    # Steps the old default wrote (a set pickled with a warning) are still refused by the
    # default and restored under "allow": their items did not change meaning.
    allow = make_store(allowing_pickle(policy))
    allow.save(2, {"extra": {"seen": argparse.Namespace(a={1, 2})}}).wait(60)
    assert manifest_path(shm_root, 2).exists()
    assert allow.restore()["extra"]["seen"] == argparse.Namespace(a={1, 2})
    allow.close()
    default = make_store()
    msg = error_of(default.restore, tiercel.InvalidArgumentError)
    assert "item 'extra/seen' is a pickled Namespace" in msg, msg


def test_float_fields_keep_their_bits():
    for x in (0.1, -0.0, math.inf, float("nan"), 5e-324):
        tree, _ = flatten("x", complex(x, -x))
        back = unflatten(tree, [])
        assert struct.pack("<dd", back.real, back.imag) == struct.pack("<dd", x, -x)


@dataclasses.dataclass
class Meters:
    seen: int
    values: np.ndarray


def orbax_plain(policy: dict, directory: str) -> str:
    """Plain-type leaves of an Orbax pytree through tiercel.orbax and back (run through
    conftest.run_isolated: JAX in its own process)."""
    import tiercel.orbax

    import orbax_worker as ow

    state = {"seen": {3, 1}, "when": dt.datetime(2026, 12, 3, 8, tzinfo=dt.timezone.utc), "mode": Mode.EVAL,
             "dir": pathlib.Path("runs/a"), "meters": Meters(2, np.arange(4.0)), "w": np.ones(3, dtype=np.float32)}
    handler = tiercel.orbax.TiercelCheckpointHandler(policy)
    mngr = ow.manager(handler, directory)
    mngr.save(3, args=ow.ocp.args.Composite(state=tiercel.orbax.Save(state)))
    mngr.wait_until_finished()
    got = ow.restore(mngr, 3, None)
    mngr.close()
    same(dict(sorted(got.items())), dict(sorted(state.items())))  # JAX orders a dict's keys
    return "same"


def test_orbax_leaves_of_plain_types_round_trip(tmp_path, shm_root):
    from conftest import make_policy, run_isolated

    pytest.importorskip("orbax.checkpoint")
    assert run_isolated("test_plain_types", "orbax_plain", make_policy(shm_root, None), str(tmp_path / "orbax"),
                        timeout=300) == "same"
