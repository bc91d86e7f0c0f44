"""A step's tensors as Hugging Face safetensors files, loadable by `safetensors.torch.load_file`
(and `transformers`) without tiercel, whichever adapter saved the step:

    tiercel export 40 /ckpt/st --format safetensors [--max-shard-size 5GB]

The files are written here, without the `safetensors` package: 8 bytes of header length
(little-endian), the JSON header (each tensor's dtype, shape and byte range; padded with
spaces to a multiple of 8), then the tensors' bytes. Up to `max_shard_size` (5 GB, as
transformers' `save_pretrained`) the step is one `model.safetensors`; above it,
`model-00001-of-0000N.safetensors` files and `model.safetensors.index.json` (`weight_map`:
tensor -> file), written last. A tensor bigger than the limit has a file of its own.

Names are the tensors' paths in the saved tree, keys and list indices joined with "." (a
state dict's "model.0.weight" is put "model", then "0", then "weight"), behind a prefix
ending in "/" where a step holds several parts: "rank1/" for rank 1 of a plain save of
several ranks, the file ("global_step40/mp_rank_00_model_states.pt/") for DeepSpeed, the
item ("state/") for an Orbax step of several items. DCP's own names (FQNs) are kept, each
tensor whole (its shards put together). Orbax leaves are global arrays.

Values that are not tensors (ints, strings, pickled objects, DCP's serialized objects) and
tensors of a dtype safetensors has no name for are skipped: `skipped.json`, beside the files,
lists each by name with its type (and the value itself when it is a JSON number, string,
bool or null).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import struct
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np

from . import exports
from ._dtypes import ITEMSIZE
from ._tree import unflatten
from .errors import IntegrityError, InvalidArgumentError, TiercelError
from .exports import Progress
from .manifest import Item
from .step import Reader
from .store import Store

#: transformers' default `max_shard_size` ("5GB": decimal).
DEFAULT_MAX_SHARD_SIZE = 5 * 10**9
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
SKIPPED_FILE = "skipped.json"

#: tiercel's dtype names -> safetensors'.
DTYPES = {
    "bool": "BOOL", "uint8": "U8", "int8": "I8", "int16": "I16", "uint16": "U16", "int32": "I32", "uint32": "U32",
    "int64": "I64", "uint64": "U64", "float16": "F16", "bfloat16": "BF16", "float32": "F32", "float64": "F64",
    "float8_e4m3fn": "F8_E4M3", "float8_e5m2": "F8_E5M2", "complex64": "C64",
}


@dataclass
class Tensor:
    """One tensor to write: its name, dtype (tiercel's name), shape, and how to read its bytes
    (C order) when its turn comes, so that one tensor at a time is held in memory."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    read: Callable[[], Any]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * ITEMSIZE[self.dtype]


@dataclass
class Collected:
    """What a step holds: the tensors to write, and what is skipped (name -> type, value).
    `where` ("step 40") begins its errors."""

    where: str
    tensors: list[Tensor] = field(default_factory=list)
    skipped: dict[str, dict[str, Any]] = field(default_factory=dict)
    _names: set[str] = field(default_factory=set)

    def tensor(self, name: str, dtype: str, shape: tuple[int, ...], read: Callable[[], Any]) -> None:
        if dtype not in DTYPES:
            self.skip(name, f"tensor of dtype {dtype}, which safetensors has no name for")
            return
        self._new(name)
        self.tensors.append(Tensor(name, dtype, tuple(int(n) for n in shape), read))

    def skip(self, name: str, what: str, value: Any = None) -> None:
        self._new(name)
        note: dict[str, Any] = {"type": what}
        if type(value) in (int, str, bool) or (type(value) is float and math.isfinite(value)):
            note["value"] = value
        self.skipped[name] = note

    def _new(self, name: str) -> None:
        if name in self._names:
            raise InvalidArgumentError(f"{self.where}: two values have the name '{name}' in safetensors' flat namespace "
                                       "(a key with a '.' in it beside a nested one?); export another format (--format)")
        self._names.add(name)


# -- the tensors of each format ------------------------------------------------------------


def _walk(out: Collected, reader: Reader, value: Any, prefix: str, path: list[str]) -> None:
    """Every leaf of a put rebuilt with Items in place of its arrays: tensors and the rest,
    named `prefix` + the path joined with "."."""
    name = prefix + ".".join(path) if path else prefix.rstrip("/")
    if isinstance(value, Item):
        if value.kind == "array":
            out.tensor(name, value.dtype, value.shape, _reads(reader, value))
        else:
            out.skip(name, f"{value.framework} item")
    elif isinstance(value, dict):
        for k, v in value.items():
            _walk(out, reader, v, prefix, [*path, str(k)])
    elif isinstance(value, (list, tuple)):
        keys = getattr(value, "_fields", None) or [str(i) for i in range(len(value))]
        for k, v in zip(keys, value):
            _walk(out, reader, v, prefix, [*path, k])
    elif dataclasses.is_dataclass(value) and not isinstance(value, type):
        for f in dataclasses.fields(value):
            _walk(out, reader, getattr(value, f.name), prefix, [*path, f.name])
    else:
        out.skip(name, type(value).__name__, value)


def _reads(reader: Reader, it: Item) -> Callable[[], Any]:
    return lambda: reader.read(it) if it.nbytes else b""


def _put(out: Collected, reader: Reader, put: str, prefix: str, path: list[str]) -> None:
    """One put's leaves, named `prefix` + `path` + the keys below the put."""
    items = reader.items(put)
    try:
        value = unflatten(reader.manifest.trees[put], items)
    except TiercelError:  # a class recorded in the tree is not importable here: the items alone,
        for it in items:  # named as the manifest names them ("put/key/key")
            name = prefix + ".".join([*path, *it.name.split("/")[1:]])
            if it.kind == "array":
                out.tensor(name, it.dtype, it.shape, _reads(reader, it))
            else:
                out.skip(name, f"{it.framework} item")
        return
    _walk(out, reader, value, prefix, path)


def _plain(store: Store, step: int | str) -> Collected:
    from .torch_export import rank_readers

    out = Collected(f"step {step}")
    readers = rank_readers(store, int(step))
    for reader in readers:
        prefix = f"rank{reader.rank}/" if len(readers) > 1 else ""
        for put in reader.manifest.trees:
            _put(out, reader, put, prefix, [put])
    return out


def _deepspeed(store: Store, step: int | str) -> Collected:
    from .deepspeed.exporter import select, step_files

    _, saves, view = select(store, step)
    out = Collected(f"step {step}")
    for rel, (rank, put) in sorted(step_files(saves).items()):
        _put(out, view.reader(rank), put, f"{rel}/", [])  # the put's own name is the file's
    return out


def _dcp(store: Store, step: int | str) -> Collected:
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from . import _dtypes
    from .dcp.export import items_by_rank
    from .dcp.reader import metadata_bytes, unpickle_metadata

    step = int(step)
    metadata = unpickle_metadata(metadata_bytes(Reader(store, step, rank=0)), step)
    pieces: dict[str, list[tuple[Any, Reader, Item]]] = {}
    for items in items_by_rank(store, step, metadata).values():
        for index, reader, it in items:
            pieces.setdefault(index.fqn, []).append((index, reader, it))
    out = Collected(f"step {step}")
    for fqn, md in metadata.state_dict_metadata.items():
        if not isinstance(md, TensorStorageMetadata):
            out.skip(fqn, "a DCP-serialized object")
            continue
        dtype, shape = _dtypes.torch_name(md.properties.dtype), tuple(int(n) for n in md.size)
        out.tensor(fqn, dtype, shape, partial(_assemble, f"step {step} tensor '{fqn}'", pieces.get(fqn, []), dtype, shape))
    return out


def _assemble(what: str, pieces: list[tuple[Any, Reader, Item]], dtype: str, shape: tuple[int, ...]) -> np.ndarray:
    """A DCP tensor whole: each saved chunk's bytes at its offsets (bytes as uint8, so any dtype).
    DCP's chunks of a tensor do not overlap, so they cover it when their sizes add up."""
    covered = sum(math.prod(it.shape) for _, _, it in pieces)
    if covered != math.prod(shape):
        raise IntegrityError(f"{what}: DCP's metadata names chunks of {covered} of its {math.prod(shape)} elements "
                             f"(shape {shape}); the step is incomplete: export it as dcp, or restore an older step")
    size = ITEMSIZE[dtype]
    whole = np.zeros((*shape, size), dtype=np.uint8)
    for index, reader, it in pieces:
        if not it.nbytes:
            continue
        chunk = np.frombuffer(reader.read(it), dtype=np.uint8).reshape(*it.shape, size)
        offsets = tuple(index.offset) if index.offset is not None else (0,) * len(shape)
        whole[tuple(slice(int(o), int(o) + n) for o, n in zip(offsets, it.shape))] = chunk
    return whole


def _orbax(store: Store, step: int | str) -> Collected:
    from .orbax._restore import SavedStep

    step = int(step)
    puts = exports.orbax_items(store.reader(step, rank=0).manifest)
    out = Collected(f"step {step}")
    for put in puts:
        saved = SavedStep(store, step, put)
        prefix = f"{put}/" if len(puts) > 1 else ""
        for leaf in saved.leaves:
            name = prefix + ".".join(str(key) for _, key in leaf.path)
            if leaf.type in ("jax", "numpy"):
                box = tuple((0, int(n)) for n in leaf.shape)
                out.tensor(name, leaf.dtype, leaf.shape, partial(_fill, saved, leaf, box))
            else:
                out.skip(name, leaf.type if leaf.type != "python" else type(leaf.value).__name__, leaf.value)
    return out


def _fill(saved: Any, leaf: Any, box: tuple[tuple[int, int], ...]) -> np.ndarray:
    """An Orbax leaf's global array, from every rank's shards."""
    arr: np.ndarray = saved.fill(saved.plan_box(leaf, box))
    return arr


#: The detected format -> the tensors of a step in it.
SOURCES: dict[str, Callable[[Store, int | str], Collected]] = {
    "torch": _plain, "deepspeed": _deepspeed, "dcp": _dcp, "orbax": _orbax,
}


# -- writing -------------------------------------------------------------------------------


def parse_size(size: int | str) -> int:
    """A shard size: bytes, or "5GB" / "500MB" (powers of 1000) / "2GiB" (of 1024), as transformers reads them."""
    if isinstance(size, int) and not isinstance(size, bool):
        n = size
    else:
        m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kmgt]i?b|b)?\s*", str(size), re.IGNORECASE)
        if m is None:
            raise InvalidArgumentError(f"max shard size '{size}': give bytes or a size such as 5GB, 500MB, 2GiB")
        unit = (m.group(2) or "b").lower()
        scale = 1 if unit == "b" else (1024 if "i" in unit else 1000) ** ("kmgt".index(unit[0]) + 1)
        n = int(float(m.group(1)) * scale)
    if n <= 0:
        raise InvalidArgumentError(f"max shard size {size!r} must be more than 0 bytes")
    return n


def shards(tensors: list[Tensor], max_size: int) -> list[list[Tensor]]:
    """Tensors in order into files of at most `max_size` bytes (transformers' rule: a new file
    when the next tensor would overflow this one; a tensor bigger than the limit alone)."""
    files: list[list[Tensor]] = [[]]
    size = 0
    for t in tensors:
        if files[-1] and size + t.nbytes > max_size:
            files.append([])
            size = 0
        files[-1].append(t)
        size += t.nbytes
    return files


def header(tensors: list[Tensor], metadata: dict[str, str]) -> tuple[bytes, list[Tensor]]:
    """The file's header (length prefix included) and its tensors in file order: widest dtype
    first, so that every tensor starts at a multiple of its element size (the header is
    padded to 8 bytes)."""
    ordered = sorted(tensors, key=lambda t: -ITEMSIZE[t.dtype])
    entries: dict[str, Any] = {"__metadata__": metadata}
    offset = 0
    for t in ordered:
        entries[t.name] = {"dtype": DTYPES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + t.nbytes]}
        offset += t.nbytes
    text = json.dumps(entries, separators=(",", ":"), ensure_ascii=False).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text, ordered


def _write_file(path: Path, tensors: list[Tensor], metadata: dict[str, str], progressed: Callable[[int], None]) -> None:
    head, ordered = header(tensors, metadata)
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "wb") as f:
        f.write(head)
        for t in ordered:
            data = _raw(t.read())
            if data.nbytes != t.nbytes:
                raise InvalidArgumentError(f"step {metadata['tiercel_step']} tensor '{t.name}': read {data.nbytes} bytes, its dtype and shape make "
                                           f"{t.nbytes}; the step's manifest and data disagree (run tiercel verify)")
            f.write(data)
            progressed(t.nbytes)
        f.flush()
        os.fsync(f.fileno())
    tmp.rename(path)


def _raw(value: Any) -> memoryview:
    """A tensor's bytes, C order (numpy's bfloat16 and float8 export no buffer format: as bytes)."""
    if isinstance(value, np.ndarray):
        value = np.ascontiguousarray(value).reshape(-1).view(np.uint8)
    return memoryview(value).cast("B")


def _write_json(path: Path, value: Any) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(value, indent=1, ensure_ascii=False) + "\n")
    tmp.rename(path)


def write(store: Store, step: int | str, out: Path, *, progress: Progress | None = None,
          max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE) -> Path:
    """The registry's exporter (tiercel.exports): `out` is new or empty."""
    limit = parse_size(max_shard_size)
    source = exports.resolve(store, step, None)
    collected = SOURCES[source](store, step)
    total = sum(t.nbytes for t in collected.tensors)
    done = [0]

    def progressed(n: int) -> None:
        done[0] += n
        if progress is not None:
            progress(done[0], total)

    out.mkdir(parents=True, exist_ok=True)
    metadata = {"format": "pt", "tiercel_step": str(step), "tiercel_saved_as": source}
    if collected.skipped:
        _write_json(out / SKIPPED_FILE, collected.skipped)
    files = shards(collected.tensors, limit)
    if len(files) == 1:
        _write_file(out / SINGLE_FILE, files[0], metadata, progressed)
        return out
    weight_map = {}
    for i, tensors in enumerate(files):
        name = f"model-{i + 1:05d}-of-{len(files):05d}.safetensors"
        _write_file(out / name, tensors, metadata, progressed)
        weight_map.update({t.name: name for t in tensors})
    _write_json(out / INDEX_FILE, {"metadata": {"total_size": total}, "weight_map": weight_map})
    return out


def skipped(out: Path) -> dict[str, Any]:
    """What an export into `out` skipped (empty when nothing)."""
    path = out / SKIPPED_FILE
    return dict(json.loads(path.read_text())) if path.exists() else {}

