"""The manifest of one rank's step as typed Python objects.

The core reads and verifies the manifest (docs/format.md); this module only gives its JSON a
shape that code and type checkers can rely on. Nothing here touches item bytes.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from typing import Any

from ._nodes import check_tree
from .errors import IntegrityError


@dataclass(frozen=True)
class Shard:
    """Where an item sits in a larger (global) array: the item holds the box that starts at
    `offsets` and has the item's own shape. Copies of the same box on several data-parallel
    replicas share `offsets`; `replica_id` tells them apart (0 is the one that is saved)."""

    global_shape: tuple[int, ...]
    offsets: tuple[int, ...]
    replica_id: int = 0

    def to_json(self) -> dict[str, Any]:
        return {"global_shape": list(self.global_shape), "offsets": list(self.offsets), "replica_id": self.replica_id}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> Shard:
        return cls(tuple(d["global_shape"]), tuple(d["offsets"]), int(d.get("replica_id", 0)))


@dataclass(frozen=True)
class Chunk:
    """One stored chunk of an item: the unit of I/O, checksum (CRC32C) and compression."""

    offset: int
    len: int
    crc32c: int
    object: int
    stored_offset: int
    stored_len: int
    codec: str
    #: XXH3-128 of the raw bytes (32 hex digits): which bytes these are; None in manifests
    #: written before chunks carried it.
    hash: str | None = None

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> Chunk:
        # Fields this reader does not know are ignored (docs/format.md, "Versioning"): a
        # field old readers may safely ignore is added without a new version.
        return cls(**{k: d[k] for k in _CHUNK_FIELDS if k in d})


_CHUNK_FIELDS = tuple(f.name for f in fields(Chunk))


@dataclass(frozen=True)
class Item:
    """One named array, tensor or byte string of one rank."""

    #: Position in the manifest; what `Reader.read` and the core take.
    index: int
    #: The put it belongs to ("model", "optim", ...).
    put: str
    #: Path-like name: the put name, then the keys down the tree ("optim/state/0/exp_avg").
    name: str
    #: "array" (dtype + shape) or "bytes".
    kind: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int
    #: What the leaf handler that wrote it needs to rebuild it ("framework", ...).
    meta: dict[str, Any]
    shard: Shard | None
    chunks: tuple[Chunk, ...]
    #: For a replicated put: the rank whose copy persistent tiers store (its replica group's
    #: lowest rank); None otherwise, and for items that ranks were found to hold alike when
    #: they saved (`"matched"`: stored once too, but not restored as a replica group).
    replica_primary: int | None = None

    @property
    def framework(self) -> str:
        """The leaf handler that rebuilds this item (see tiercel.leaves)."""
        fw = self.meta.get("framework")
        if fw:
            return str(fw)
        # Byte items of format version 1 name no framework: pickles say so in "type".
        return "pickle" if self.meta.get("type") == "pickle" else "bytes"

    @property
    def stored_bytes(self) -> int:
        return sum(c.stored_len for c in self.chunks)


@dataclass(frozen=True)
class Manifest:
    """What one rank wrote for one step, as the tier it was read from describes it."""

    format: str
    version: int
    step: int
    rank: int
    world_size: int
    tier: str
    chunk_size: int
    #: (name, length) of each stored data object.
    objects: tuple[tuple[str, int], ...]
    #: The tree of each put, in put order (opaque structure; see tiercel._nodes).
    trees: dict[str, dict]
    items: tuple[Item, ...]

    @classmethod
    def from_json(cls, text: str | bytes) -> Manifest:
        d = json.loads(text)
        trees = {name: tree for name, tree in d["trees"]}
        # Items are numbered across puts in put order; each tree refers to its own put's items.
        owners: list[str] = []
        for name, tree in d["trees"]:
            owners += [name] * len(check_tree(tree, f"step {d['step']} rank {d['rank']} put '{name}'"))
        if len(owners) != len(d["items"]):
            raise IntegrityError(f"step {d['step']} rank {d['rank']}: the trees refer to {len(owners)} items, the manifest "
                                 f"lists {len(d['items'])}; the manifest is damaged")
        items = tuple(
            Item(
                index=i,
                put=owners[i] if i < len(owners) else "",
                name=it["name"],
                kind=it["kind"],
                dtype=it["dtype"],
                shape=tuple(it["shape"]),
                nbytes=it["nbytes"],
                meta=it.get("meta") or {},
                shard=Shard.from_json(it["shard"]) if it.get("shard") else None,
                chunks=tuple(Chunk.from_json(c) for c in it["chunks"]),
                replica_primary=it["replica"]["primary"] if it.get("replica") and not it["replica"].get("matched") else None,
            )
            for i, it in enumerate(d["items"])
        )
        return cls(
            format=d["format"],
            version=d["version"],
            step=d["step"],
            rank=d["rank"],
            world_size=d["world_size"],
            tier=d["tier"],
            chunk_size=d["chunk_size"],
            objects=tuple((o["name"], o["len"]) for o in d["objects"]),
            trees=trees,
            items=items,
        )

    def puts(self) -> list[str]:
        return list(self.trees)

    def items_of(self, put: str) -> list[Item]:
        """The items of one put, in the order its tree refers to them."""
        return [it for it in self.items if it.put == put]

    def item(self, name: str) -> Item:
        for it in self.items:
            if it.name == name:
                return it
        raise KeyError(name)

    @property
    def raw_bytes(self) -> int:
        return sum(it.nbytes for it in self.items)

    @property
    def stored_bytes(self) -> int:
        return sum(n for _, n in self.objects)
