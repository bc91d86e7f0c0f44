"""Policy files: every mistake is a ConfigError that names the file, the line and the key;
where a Store finds its policy ($TIERCEL_POLICY, ./tiercel.toml)."""

from __future__ import annotations

import numpy as np
import pytest

import tiercel

from conftest import assert_same, error_of

GOOD = """\
[[tier]]
name = "ram"
kind = "memory"
root = "{ram}"
capacity = "64MiB"
keep = 2

[[tier]]
name = "disk"
kind = "fs"
url = "{disk}"
every = 2
keep = 3
compression = "zstd:3"
bandwidth = "100MB/s"

[restore]
order = ["ram", "disk"]

[store]
chunk_size = "64KiB"
threads = 2
io_threads = 1
"""


@pytest.fixture
def good(shm_root, disk_root):
    return GOOD.format(ram=shm_root, disk=disk_root)


def config_error(path) -> str:
    return error_of(lambda: tiercel.Store(str(path), rank=0, world_size=1), tiercel.ConfigError)


def assert_points_at(msg: str, path, line: int, *keys: str) -> None:
    assert msg.startswith(f"{path}:{line}:"), f"expected '{path}:{line}:' at the start of: {msg}"
    assert "\n" not in msg, repr(msg)
    for k in keys:
        assert k in msg, f"{k!r} not in: {msg}"


def test_good_policy_loads(tmp_path, good, shm_root, disk_root):
    p = tmp_path / "tiercel.toml"
    p.write_text(good)
    with tiercel.Store(str(p), rank=0, world_size=1) as s:
        tiers = {t["name"]: t for t in s.tiers()}
        assert tiers["ram"]["kind"] == "memory" and tiers["ram"]["location"] == str(shm_root)
        assert tiers["ram"]["capacity"] == 64 << 20 and tiers["ram"]["keep"] == 2
        assert tiers["disk"]["kind"] == "fs" and tiers["disk"]["location"] == str(disk_root)
        assert (tiers["disk"]["every"], tiers["disk"]["keep"]) == (2, 3)
        assert tiers["disk"]["compression"] == "zstd:3" and tiers["disk"]["bandwidth"] == 100_000_000
        assert s._core.chunk_size == 64 << 10
        assert s._core.restore_order == ["ram", "disk"]
        assert s._core.replicated_policy() == ("all", 64 << 20, 30.0)
        assert s._core.policy_source == str(p)
        h = s.save(2, {"x": np.arange(10)})
        assert h.wait(60) == {"ram": "committed", "disk": "committed"}
        assert_same(s.restore(), {"x": np.arange(10)})


def nth_line(text: str, needle: str, nth: int = 1) -> int:
    """1-based number of the nth line that contains `needle`."""
    hits = [i for i, line in enumerate(text.splitlines(), 1) if needle in line]
    assert len(hits) >= nth, f"{needle!r} x{nth} not in policy text"
    return hits[nth - 1]


# name: ((old, new) change to GOOD, (text on the line the error must point at, which
# occurrence), keys the message must name)
CASES = {
    "unknown key": (("every = 2\n", "every = 2\nevry = 3\n"), ("evry = 3", 1), ["evry", "did you mean `every`"]),
    "wrong type": (("keep = 3\n", 'keep = "3"\n'), ('keep = "3"', 1), ['("disk").keep', "positive integer", '"3"']),
    "negative keep": (("keep = 3\n", "keep = -1\n"), ("keep = -1", 1), ["keep", "-1"]),
    "bad size": (('capacity = "64MiB"', 'capacity = "64XB"'), ("capacity", 1), ['("ram").capacity', '"64XB"', "not a size"]),
    "bits not bytes": (('bandwidth = "100MB/s"', 'bandwidth = "1Gb/s"'), ("bandwidth", 1), ["bandwidth", "bits"]),
    "bad compression": (('compression = "zstd:3"', 'compression = "lz4"'), ("compression", 1), ["compression", '"lz4"']),
    "bad chunk size": (('chunk_size = "64KiB"', 'chunk_size = "1000"'), ("chunk_size", 1), ["store.chunk_size", "4096"]),
    "missing name": (('name = "disk"\n', ""), ("[[tier]]", 2), ["tier[1]", "missing `name`"]),
    "first tier not memory": (('kind = "memory"', 'kind = "fs"'), ('kind = "fs"', 1), ["tier[0]", "kind", 'first tier must be kind "memory"']),
    "unknown kind": (('kind = "fs"', 'kind = "tape"'), ('kind = "tape"', 1), ["kind", '"tape"', '"memory", "fs"']),
    "unknown tier in restore order": (('order = ["ram", "disk"]', 'order = ["ram", "tape"]'), ("order =", 1), ["restore.order[1]", '"tape"']),
    "key in the wrong table": (("threads = 2\n", "threads = 2\nevery = 2\n"), ("every = 2", 2), ["store.every", "[[tier]]"]),
    "unknown replicated mode": (('order = ["ram", "disk"]\n', 'order = ["ram", "disk"]\nreplicated = "one"\n'),
                                ('replicated = "one"', 1), ["restore.replicated", '"single", "striped", "all", "auto"']),
    "bad relay window": (('order = ["ram", "disk"]\n', 'order = ["ram", "disk"]\nrelay_window = "lots"\n'),
                         ("relay_window", 1), ["restore.relay_window", '"lots"']),
    "zero relay timeout": (('order = ["ram", "disk"]\n', 'order = ["ram", "disk"]\nrelay_timeout = 0\n'),
                           ("relay_timeout", 1), ["restore.relay_timeout", "positive integer"]),
    "url on a memory tier": (("keep = 2\n", 'keep = 2\nurl = "/x"\n'), ('url = "/x"', 1), ['("ram").url', "use `root`"]),
}


@pytest.mark.parametrize("case", list(CASES))
def test_policy_errors_name_file_line_and_key(tmp_path, good, case):
    (old, new), (needle, nth), keys = CASES[case]
    assert old in good
    text = good.replace(old, new, 1)
    p = tmp_path / "policy.toml"
    p.write_text(text)
    assert_points_at(config_error(p), p, nth_line(text, needle, nth), *keys)


# name: (old, new, text on the line the error must point at)
SYNTAX = {
    "unquoted string": ('compression = "zstd:3"', "compression = zstd", "compression = zstd"),
    "unclosed array at the end": ("io_threads = 1\n", "io_threads = [1,\n", "io_threads"),
    "duplicate key": ("every = 2\n", "every = 2\nevery = 4\n", "every = 4"),
    "bad table header": ("[store]", "[store", "[store"),
}


@pytest.mark.parametrize("case", list(SYNTAX))
def test_toml_syntax_errors_name_file_and_line(tmp_path, good, case):
    old, new, needle = SYNTAX[case]
    text = good.replace(old, new, 1)
    p = tmp_path / "policy.toml"
    p.write_text(text)
    assert_points_at(config_error(p), p, nth_line(text, needle), "invalid TOML")


def test_toml_syntax_error_names_the_key(tmp_path, good):
    p = tmp_path / "policy.toml"
    p.write_text(good.replace('compression = "zstd:3"', "compression = zstd"))
    assert "compression" in config_error(p)


def test_dict_policy_errors_name_the_key(shm_root):
    pol = {"tier": [{"name": "ram", "kind": "memory", "root": str(shm_root), "keep": 0}]}
    msg = error_of(lambda: tiercel.Store(pol, rank=0, world_size=1), tiercel.ConfigError)
    assert msg.startswith("<dict>: tier[0].keep:"), msg
    pol = {"tier": [{"name": "ram", "kind": "memory", "root": str(shm_root)}], "stor": {}}
    msg = error_of(lambda: tiercel.Store(pol, rank=0, world_size=1), tiercel.ConfigError)
    assert "stor" in msg and "did you mean `store`" in msg, msg


def test_missing_and_empty_policy_files(tmp_path):
    missing = tmp_path / "nope.toml"
    msg = config_error(missing)
    assert str(missing) in msg and "cannot read" in msg, msg
    empty = tmp_path / "empty.toml"
    empty.write_text("")
    msg = config_error(empty)
    assert msg.startswith(f"{empty}:") and "no tiers" in msg, msg
    directory = tmp_path / "dir.toml"
    directory.mkdir()
    assert str(directory) in config_error(directory)


def test_policy_from_environment(tmp_path, monkeypatch, good):
    p = tmp_path / "elsewhere.toml"
    p.write_text(good)
    monkeypatch.setenv("TIERCEL_POLICY", str(p))
    monkeypatch.chdir(tmp_path)  # no ./tiercel.toml here
    with tiercel.Store.open() as s:
        assert s._core.policy_source == str(p)
        assert [t["name"] for t in s.tiers()] == ["ram", "disk"]
        assert (s.rank, s.world_size) == (0, 1)
        s.save(1, {"a": np.ones(3)}).wait(60)
        assert_same(s.restore(), {"a": np.ones(3)})
    # A broken file named by the variable is reported by its path.
    p.write_text(good.replace("keep = 3", "keep = 0"))
    msg = error_of(tiercel.Store.open, tiercel.ConfigError)
    assert_points_at(msg, p, nth_line(good, "keep = 3"), "keep")


def test_policy_from_working_directory(tmp_path, monkeypatch, good):
    work = tmp_path / "job"
    work.mkdir()
    (work / "tiercel.toml").write_text(good)
    monkeypatch.chdir(work)
    with tiercel.Store.open() as s:
        assert s._core.policy_source == "tiercel.toml"
        assert s.tiers()[0]["capacity"] == 64 << 20
    # $TIERCEL_POLICY wins over ./tiercel.toml.
    other = tmp_path / "other.toml"
    other.write_text(good.replace('capacity = "64MiB"', 'capacity = "32MiB"'))
    monkeypatch.setenv("TIERCEL_POLICY", str(other))
    with tiercel.Store.open() as s:
        assert s.tiers()[0]["capacity"] == 32 << 20
    # Neither: the error says which file was looked for.
    monkeypatch.delenv("TIERCEL_POLICY")
    (work / "tiercel.toml").unlink()
    msg = error_of(tiercel.Store.open, tiercel.ConfigError)
    assert "tiercel.toml" in msg and "cannot read" in msg, msg
