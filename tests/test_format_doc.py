"""docs/format.md stands on its own (issue 14.16): its example reader, taken from the page
as it is, reads a checkpoint holding every dtype the format lists, pickled numpy arrays,
bytes, and every codec, bit-exactly; dtypes the page does not list are refused at save."""

from __future__ import annotations

import re
import shutil
import warnings

import numpy as np
import pytest
import torch

import tiercel
from tiercel import _dtypes

from conftest import allowing_pickle, error_of, make_policy

DOC = tiercel.__file__.rsplit("/python/", 1)[0] + "/docs/format.md"


def doc_reader() -> dict:
    """The page's "Reading without tiercel" code block, executed as it stands."""
    text = open(DOC).read()
    section = text[text.index("## Reading without tiercel"):]
    code = re.search(r"```python\n(.*?)```", section, re.S)
    assert code, "no python block under 'Reading without tiercel'"
    ns: dict = {}
    exec(compile(code.group(1), DOC, "exec"), ns)
    return ns


def every_dtype() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    out = {}
    for name in _dtypes.ITEMSIZE:
        dt = getattr(torch, name)
        bits = torch.randint(0, 256, (3, 5, _dtypes.ITEMSIZE[name]), dtype=torch.uint8, generator=g)
        if dt == torch.bool:
            out[name] = bits[..., 0] % 2 == 1
        else:
            out[name] = bits.view(dt).reshape(3, 5)  # every bit pattern, NaNs included
    return out


@pytest.mark.skipif(shutil.which("zstd") is None, reason="the doc's reader decodes with the zstd command")
@pytest.mark.parametrize("compression", ["none", "zstd:3", "bytegroup+zstd:1"])
def test_the_documented_reader_reads_every_dtype(shm_root, tmp_path, compression):
    disk = tmp_path / "disk"
    tensors = every_dtype()
    rng = np.random.default_rng(0)
    odd = {"f128": np.arange(4, dtype=np.longdouble), "when": np.array(["2026-12-01"], dtype="datetime64[D]"),
           "text": np.array(["a", "bc"]), "rec": np.zeros(2, dtype=[("x", "i4"), ("y", "f8")])}
    state = {"t": tensors, "np": {"big": rng.standard_normal(40_000).astype(np.float32)}, "raw": {"b": b"hello"},
             "odd": odd}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # nothing to hear: odd dtypes are pickled silently under "allow"
        # The odd numpy dtypes are pickled, which only "allow" saves (its restores unpickle).
        pol = allowing_pickle(make_policy(shm_root, disk, every=1, compression=compression))
        with tiercel.Store(pol, rank=0, world_size=1) as s:
            s.save(1, state).wait(60)
    got = doc_reader()["read_rank"](str(disk), 1, 0)
    for name, t in tensors.items():
        arr = got[f"t/{name}"]
        if name == "complex32":
            want = t.to(torch.complex64).numpy()
            same = (arr == want) | (np.isnan(arr.real) & np.isnan(want.real)) | (np.isnan(arr.imag) & np.isnan(want.imag))
            assert same.all(), name
        else:
            assert arr.shape == (3, 5) and arr.tobytes() == t.contiguous().view(torch.uint8).numpy().tobytes(), name
            assert arr.dtype.itemsize == _dtypes.ITEMSIZE[name], name
    assert got["np/big"].tobytes() == state["np"]["big"].tobytes()
    assert got["raw/b"] == b"hello"
    for k, v in odd.items():
        assert got[f"odd/{k}"].dtype == v.dtype and got[f"odd/{k}"].tobytes() == v.tobytes(), k


@pytest.mark.parametrize("dtype", ["float8_e8m0fnu", "float4_e2m1fn_x2", "uint1", "int4", "bits8", "bits16"])
def test_dtypes_the_format_does_not_list_are_refused(store, dtype):
    """Repro: a reader written from format.md met dtypes the page does not list
    (`float8_e8m0fnu`, `float4_e2m1fn_x2` with an unstated nibble order, `int1`-`int7`,
    `bits8`, `bits16`). Now a save refuses them, naming the item."""
    t = torch.zeros(4, dtype=torch.uint8).view(getattr(torch, dtype)) if dtype not in ("uint1", "int4") \
        else torch.empty(4, dtype=getattr(torch, dtype))
    msg = error_of(lambda: store.save(1, {"m": {"w": t}}), tiercel.InvalidArgumentError)
    assert "'m/w'" in msg and dtype in msg, msg


def test_numpy_matrix_is_refused(store):
    """Repro: an np.matrix came back a plain array without a word."""
    msg = error_of(lambda: store.save(1, {"m": {"x": np.matrix([[1, 2], [3, 4]])}}), tiercel.InvalidArgumentError)
    assert "'m/x'" in msg and "matrix" in msg, msg
