"""How a pytree is laid out in a tiercel step, one put per Orbax item and rank.

Each rank puts a dict:

    {"format": "tiercel-orbax", "version": 1, "process_count": P,
     "leaves": [{"key": "['params']['w']", "path": [["d", "params"], ["d", "w"]],
                 "type": "jax" | "numpy" | "python" | "object" | "empty",
                 "shape": [...], "dtype": "float32",          # arrays
                 "shards": [JaxShard, ...],                    # jax: this rank's distinct shards
                 "sharding": 0,                                # jax: index into "shardings"
                 "prng_impl": "threefry2x32",                  # typed PRNG keys (their key data is stored)
                 "node": "none" | "dict" | "list" | "tuple" | "masked",   # empty subtrees
                 "value": ...}],                               # the rest: rank 0 only
     "shardings": ["<Orbax's ShardingMetadata, serialized>", ...],
     "custom_metadata": ...}                                   # Save(custom_metadata=)

jax.Array leaves: every process writes the shards it holds with replica_id 0, so each
distinct shard is written once per replica group; a fully addressable array in a job of
several processes (the same everywhere) is written by process 0 only, as numpy arrays and
other values are. Every rank writes the leaf list itself (small, in its manifest), so the
structure can be read from any rank.

Orbax's contract, kept here: a jax.Array's sharding is recorded (Orbax's own
ShardingMetadata), so a restore without a target rebuilds it; `SaveArgs(dtype=)` casts before
the copy; a typed PRNG key array is stored as its key data with the name of its
implementation; empty subtrees (None, {}, [], optax.MaskedNode()) are recorded, so a restore
gives them back (a masked leaf restores as None).
"""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

import jax
import numpy as np
from orbax.checkpoint._src.metadata import sharding as sharding_metadata

from .. import _tree
from .._tree import unflatten
from ..manifest import Item, Manifest
from ._leaf import JaxShard, dtype_name, on_host

FORMAT = "tiercel-orbax"
VERSION = 1

#: Path element kinds: dict key, sequence index, attribute, flattened index.
_KEY_KINDS = {jax.tree_util.DictKey: "d", jax.tree_util.SequenceKey: "i", jax.tree_util.GetAttrKey: "a",
              jax.tree_util.FlattenedIndexKey: "f"}
_PY = (bool, int, float, str, type(None))


def _encode_path(path: Sequence[Any]) -> list[list[Any]]:
    out = []
    for k in path:
        kind = _KEY_KINDS.get(type(k), "d")
        if kind == "d":
            key = getattr(k, "key", k)
            out.append(["d", key if type(key) in _PY else str(key)])
        elif kind == "i":
            out.append(["i", k.idx])
        elif kind == "a":
            out.append(["a", k.name])
        else:
            out.append(["f", k.key])
    return out


def is_empty_node(x: Any) -> bool:
    """A subtree without leaves (None, {}, [], (), optax.MaskedNode(), an empty dataclass):
    recorded as such, since flattening would drop it."""
    return x is None or (not isinstance(x, (jax.Array, np.ndarray, np.generic)) and not jax.tree_util.tree_leaves(x))


def _node_kind(x: Any) -> str:
    if x is None:
        return "none"
    for kind, t in (("dict", dict), ("list", list), ("tuple", tuple)):
        if type(x) is t:
            return kind
    return "masked"  # any other empty node (optax.MaskedNode, EmptyState): restored as None


#: What an empty node restores as without a target.
EMPTY_VALUES: dict[str, Any] = {"none": None, "dict": {}, "list": [], "tuple": (), "masked": None}


def save_args_by_key(save_args: Any) -> dict[str, Any]:
    """Orbax's `save_args` tree (ocp.SaveArgs or None per leaf) by the leaf's key."""
    if save_args is None:
        return {}
    from orbax.checkpoint import SaveArgs

    flat, _ = jax.tree_util.tree_flatten_with_path(save_args, is_leaf=lambda x: x is None or isinstance(x, SaveArgs))
    return {jax.tree_util.keystr(p): a for p, a in flat if isinstance(a, SaveArgs)}


def _cast_for_save(leaf: Any, args: Any, key: str) -> Any:
    """`SaveArgs(dtype=)`: the leaf in that dtype (Orbax casts before it writes); `aggregate`
    is refused, as Orbax's StandardCheckpointHandler refuses it."""
    if args is None:
        return leaf
    if getattr(args, "aggregate", False):
        raise TypeError(f"'{key}': unsupported option `aggregate` of SaveArgs (Orbax removed it; tiercel never had it)")
    dtype = getattr(args, "dtype", None)
    if dtype is None:
        return leaf
    if isinstance(leaf, jax.Array):
        if jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key):
            raise TypeError(f"'{key}': SaveArgs(dtype={dtype}) cannot cast a typed PRNG key array")
        return leaf.astype(dtype)
    if isinstance(leaf, (np.ndarray, np.generic)):
        return np.asarray(leaf).astype(dtype) if isinstance(leaf, np.ndarray) else np.dtype(dtype).type(leaf)
    return leaf  # Python scalars and strings keep their type, as in Orbax


def _sharding_string(sharding: Any) -> str | None:
    """Orbax's serialized ShardingMetadata of a NamedSharding or SingleDeviceSharding (the
    kinds Orbax records); None for others."""
    if not isinstance(sharding, (jax.sharding.NamedSharding, jax.sharding.SingleDeviceSharding)):
        return None
    meta = sharding_metadata.from_jax_sharding(sharding)
    return None if meta is None else meta.to_serialized_string()


def leaf_records(state: Any, process_index: int, process_count: int, save_args: Any = None,
                 custom_metadata: Any = None) -> dict[str, Any]:
    """The put value of this process for `state`, safe to write after the caller's next
    training step: the blocking part of a save (the copy into shared memory runs later, in
    the background). `save_args`: Orbax's tree of ocp.SaveArgs (their `dtype` casts).

    What it holds on to, and why that is enough (what Orbax's own save does before it returns):
    - a jax.Array shard as a host numpy array: on CPU devices a zero-copy view that holds an
      external reference to the device buffer, so XLA never reuses that buffer: a jitted step
      that donates the array copies instead of donating, and `delete()` frees it only once the
      view is gone; on other devices the device-to-host copy, completed here (all transfers
      are started first, so they overlap);
    - numpy arrays and other objects as copies (they are mutable); Python scalars and strings
      as they are.
    """
    flat, _ = jax.tree_util.tree_flatten_with_path(state, is_leaf=is_empty_node)
    if all(is_empty_node(leaf) for _, leaf in flat):
        raise TypeError("the tree to save has no leaves (Orbax refuses an empty tree too)")
    args_of = save_args_by_key(save_args)
    records = []
    shardings: list[str] = []
    pending: list[tuple[list[JaxShard], int, Any]] = []  # (the leaf's shards, position, device array)
    for path, leaf in flat:
        key = jax.tree_util.keystr(path)
        rec: dict[str, Any] = {"key": key, "path": _encode_path(path)}
        leaf = _cast_for_save(leaf, args_of.get(key), key)
        if is_empty_node(leaf):
            rec.update(type="empty", node=_node_kind(leaf))
        elif isinstance(leaf, jax.Array):
            sharding = _sharding_string(leaf.sharding)
            if sharding is not None:
                if sharding not in shardings:
                    shardings.append(sharding)
                rec["sharding"] = shardings.index(sharding)
            if jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key):
                rec["prng_impl"] = str(jax.random.key_impl(leaf))
                rec["key_shape"] = list(leaf.shape)
                leaf = jax.random.key_data(leaf)
            rec.update(type="jax", shape=list(leaf.shape), dtype=dtype_name(leaf.dtype, key))
            shards: list[JaxShard] = []
            if not (leaf.is_fully_addressable and process_count > 1 and process_index != 0):
                for s in leaf.addressable_shards:
                    if s.replica_id != 0:
                        continue
                    offsets = tuple(sl.indices(n)[0] for sl, n in zip(s.index, leaf.shape))
                    pending.append((shards, len(shards), s.data))
                    shards.append(JaxShard(s.data, tuple(leaf.shape), offsets, 0))
            rec["shards"] = shards
        elif isinstance(leaf, (np.ndarray, np.generic)) and _is_plain_dtype(leaf):
            rec.update(type="numpy", shape=list(np.shape(leaf)), dtype=dtype_name(np.asarray(leaf).dtype, key))
            rec["scalar"] = isinstance(leaf, np.generic)
            rec["value"] = copy.deepcopy(leaf) if process_index == 0 else None
        elif type(leaf) in _PY:
            rec.update(type="python", value=leaf)
        else:  # stored by tiercel's tree (plain types) or leaf registry (pickled only where allowed)
            rec.update(type="object", value=_copied(leaf, key) if process_index == 0 else None)
        records.append(rec)
    for _, _, x in pending:
        if not on_host(x):
            x.copy_to_host_async()
    for shards, i, x in pending:
        shards[i] = dataclasses.replace(shards[i], data=np.asarray(x))
    out = {"format": FORMAT, "version": VERSION, "process_count": process_count, "leaves": records}
    if shardings:
        out["shardings"] = shardings
    if custom_metadata is not None:
        out["custom_metadata"] = _copied(custom_metadata, "custom_metadata")
    return out


def _copied(value: Any, key: str) -> Any:
    try:
        return copy.deepcopy(value)
    except Exception as e:
        raise TypeError(f"'{key}': cannot take a copy of {type(value).__name__} to save it in the background: {e}") from None


def _is_plain_dtype(x: Any) -> bool:
    from .. import _dtypes

    return _dtypes.numpy_name(np.asarray(x).dtype) is not None


@dataclass
class SavedLeaf:
    """One leaf of a saved step, gathered from every rank's manifest (no bytes read)."""

    key: str
    path: list[list[Any]]
    type: str
    shape: tuple[int, ...] = ()
    dtype: str = ""
    scalar: bool = False
    #: Every stored piece of the leaf: (rank, item). A numpy leaf is one whole piece.
    pieces: list[tuple[int, Item]] = field(default_factory=list)
    #: Python values (and "object" leaves, as the item that holds them).
    value: Any = None
    #: An "object" leaf kept in the tree (a set, a dataclass: tiercel._tree's plain types):
    #: its tree node and rank 0's items of the put, to rebuild it with any items inside it.
    tree: tuple[dict, list[Item]] | None = None
    #: A jax.Array's sharding as saved (Orbax's ShardingMetadata, serialized), if recorded.
    sharding: str | None = None
    #: A typed PRNG key array: its implementation ("threefry2x32", "rbg") and the keys' shape
    #: (`shape` is the key data's, which has the implementation's trailing dimensions).
    prng_impl: str | None = None
    key_shape: tuple[int, ...] = ()


def is_layout(tree: dict[str, Any]) -> bool:
    """Whether a put's tree (as the manifest keeps it) is a tiercel.orbax layout."""
    node = _tree.entry(tree, "format")
    return node is not None and node.get("t") == "str" and _tree.scalar_value(node) == FORMAT


def rank_records(m: Manifest, put: str) -> list[dict[str, Any]]:
    """One rank's leaf records of one put, with manifest Items in place of the arrays (no
    bytes read). Raises ValueError when the put is missing or not a tiercel.orbax layout."""
    return read_put(m, put)["leaves"]


def read_put(m: Manifest, put: str) -> dict[str, Any]:
    """One rank's put value as `leaf_records` made it, with manifest Items in place of the
    arrays and each leaf's sharding resolved (no bytes read); see rank_records."""
    if put not in m.trees:
        raise ValueError(f"rank {m.rank} put nothing under '{put}' (have: {', '.join(m.trees) or 'nothing'})")
    items = list(m.items_of(put))
    value = unflatten(m.trees[put], items)
    if not isinstance(value, dict) or value.get("format") != FORMAT:
        raise ValueError(f"'{put}' of rank {m.rank} was not saved by tiercel.orbax")
    if value["version"] > VERSION:
        raise ValueError(f"'{put}' was saved by a newer tiercel.orbax (layout version {value['version']} > {VERSION})")
    records = list(value["leaves"])
    shardings = value.get("shardings") or []
    for rec, node in zip(records, _entry(m.trees[put], "leaves")["v"]):
        if rec["type"] == "object" and not isinstance(rec["value"], Item):
            rec["tree"] = (_entry(node, "value"), items)
        if isinstance(rec.get("sharding"), int):
            rec["sharding"] = shardings[rec["sharding"]]
    value["leaves"] = records
    return value


def _entry(node: dict, key: str) -> dict:
    """The node of a dict node's entry `key` (the layout has it: checked by rank_records)."""
    found = _tree.entry(node, key)
    assert found is not None, key
    return found


def merge_layout(shares: Mapping[int, list[dict[str, Any]]]) -> list[SavedLeaf]:
    """The leaves of one put from the records of some or all ranks ({rank: records}): the
    pieces of every rank given, and the values that rank 0 alone stores if it is given."""
    if not shares:
        raise ValueError("no rank's records")
    ranks = sorted(shares)
    leaves = [
        SavedLeaf(key=rec["key"], path=rec["path"], type=rec["type"], shape=tuple(rec.get("shape") or ()),
                  dtype=rec.get("dtype", ""), scalar=bool(rec.get("scalar")),
                  value=rec.get("value") if rec["type"] == "python" else copy.copy(EMPTY_VALUES.get(rec.get("node", ""))),
                  sharding=rec.get("sharding"), prng_impl=rec.get("prng_impl"), key_shape=tuple(rec.get("key_shape") or ()))
        for rec in shares[ranks[0]]
    ]
    for rank in ranks:
        recs = shares[rank]
        if len(recs) != len(leaves) or any(r["key"] != leaf.key for r, leaf in zip(recs, leaves)):
            raise ValueError(f"rank {rank} saved a different tree than rank {ranks[0]}")
        for rec, leaf in zip(recs, leaves):
            if rec["type"] == "jax":
                leaf.pieces += [(rank, it) for it in rec["shards"]]
            elif rank == 0 and rec["type"] == "numpy":
                leaf.pieces.append((0, rec["value"]))
            elif rank == 0 and rec["type"] == "object":
                leaf.value, leaf.tree = rec["value"], rec.get("tree")
    return leaves


def nested(leaves: Sequence[SavedLeaf], values: Sequence[Any]) -> Any:
    """A tree of dicts (dict keys, attributes) and lists (sequence indices) from the saved
    paths, as Orbax returns a checkpoint restored without a target."""
    root: Any = None
    for leaf, v in zip(leaves, values):
        if not leaf.path:
            return v
        root = _insert(root, leaf.path, v)
    return _lists(root)


def _insert(node: Any, path: list[list[Any]], v: Any) -> Any:
    if node is None:
        node = {}
    kind, key = path[0]
    k = ("i", key) if kind == "i" else key
    node[k] = v if len(path) == 1 else _insert(node.get(k), path[1:], v)
    return node


def _lists(node: Any) -> Any:
    """Turns the {("i", n): ...} dicts built for sequences into lists."""
    if not isinstance(node, dict):
        return node
    if node and all(isinstance(k, tuple) for k in node):
        return [_lists(node[k]) for k in sorted(node, key=lambda k: k[1])]
    return {k: _lists(v) for k, v in node.items()}
