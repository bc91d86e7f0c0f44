"""What Orbax's StandardCheckpointHandler promises its users beyond bytes in and out, kept by
tiercel's handler: restoring without a target into the saved shardings (and Orbax's
"Topology mismatch detected" where that cannot be), typed PRNG keys, custom layouts, and
Orbax's metadata object. The reading itself is tiercel.orbax._restore's.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np
from etils import epath
from orbax.checkpoint._src.arrays import sharding as arrays_sharding
from orbax.checkpoint._src.metadata import sharding as sharding_metadata
from orbax.checkpoint._src.metadata import tree as tree_metadata
from orbax.checkpoint._src.metadata import value as value_metadata

from .. import _dtypes
from ..errors import InvalidArgumentError
from ._layout import SavedLeaf, is_empty_node, nested
from ._restore import SavedStep


class OrbaxValueError(InvalidArgumentError, ValueError):
    """An argument Orbax's own handler refuses with a ValueError (an empty tree, SaveArgs'
    `aggregate`, a topology the saved shardings cannot be rebuilt on): catchable as either."""


def _is_key(x: Any) -> bool:
    dtype = getattr(x, "dtype", None)
    return dtype is not None and isinstance(x, (jax.Array, jax.ShapeDtypeStruct)) and jax.dtypes.issubdtype(
        dtype, jax.dtypes.prng_key)


def _plain_sharding(sharding: Any) -> Any:
    """A target's sharding without its layout (a `Format` carries both)."""
    return sharding.sharding if isinstance(sharding, arrays_sharding.Format) else sharding


def _key_data_sharding(sharding: Any, key_ndim: int, extra: int) -> Any:
    """The sharding of a key array's data (the key's, with the implementation's trailing
    dimensions whole): NamedSharding and SingleDeviceSharding; None for no sharding."""
    if sharding is None or isinstance(sharding, jax.sharding.SingleDeviceSharding):
        return sharding
    if isinstance(sharding, jax.sharding.NamedSharding):
        spec = tuple(sharding.spec) + (None,) * (key_ndim - len(sharding.spec) + extra)
        return jax.sharding.NamedSharding(sharding.mesh, jax.sharding.PartitionSpec(*spec))
    raise InvalidArgumentError(f"a typed PRNG key array in a {type(sharding).__name__} cannot be restored by tiercel; "
                               "give its target a NamedSharding or a SingleDeviceSharding")


def restore_target(saved: SavedStep, target: Any, fallback: Any = None) -> Any:
    """The target as tiercel.orbax._restore reads into it, by Orbax's rules: a
    ShapeDtypeStruct without a sharding takes the one its leaf was saved with (as Orbax's
    `_construct_restore_args` does); a typed PRNG key leaf becomes its key data's (the stored
    form); a `Format` sharding its sharding. The target itself when nothing changes."""
    flat, treedef = jax.tree_util.tree_flatten_with_path(target, is_leaf=is_empty_node)
    by_key = {leaf.key: leaf for leaf in saved.leaves}
    out, changed = [], False
    for path, t in flat:
        key = jax.tree_util.keystr(path)
        leaf = by_key.get(key)
        if isinstance(t, jax.ShapeDtypeStruct) and t.sharding is None and leaf is not None and leaf.sharding is not None:
            sharding = saved_sharding(saved, leaf, fallback)
            t = jax.ShapeDtypeStruct(t.shape, t.dtype, sharding=sharding)
            changed = True
        if _is_key(t):
            if leaf is None or leaf.prng_impl is None:
                raise InvalidArgumentError(f"step {saved.step} '{saved.put}' leaf {key}: the target is a typed PRNG key "
                                           "array, the checkpoint " + ("has no such leaf" if leaf is None else
                                                                       f"holds a {leaf.type} array of {leaf.dtype}"))
            if tuple(t.shape) != leaf.key_shape:
                raise InvalidArgumentError(f"step {saved.step} leaf {key}: the target holds keys of shape "
                                           f"{tuple(t.shape)}, the checkpoint {leaf.key_shape}")
            data_sharding = _key_data_sharding(_plain_sharding(t.sharding), len(leaf.key_shape),
                                               len(leaf.shape) - len(leaf.key_shape))
            t = jax.ShapeDtypeStruct(leaf.shape, _dtypes.numpy_dtype(leaf.dtype), sharding=data_sharding)
            changed = True
        elif isinstance(t, jax.ShapeDtypeStruct) and isinstance(t.sharding, arrays_sharding.Format):
            t = jax.ShapeDtypeStruct(t.shape, t.dtype, sharding=t.sharding.sharding)
            changed = True
        out.append(t)
    return jax.tree_util.tree_unflatten(treedef, out) if changed else target


def with_formats(tree: Any, target: Any) -> Any:
    """Restore(support_layout=True): each array in the layout of its target (a jax.Array's
    `format`, or a ShapeDtypeStruct's `Format` sharding)."""
    flat_t, _ = jax.tree_util.tree_flatten(target, is_leaf=is_empty_node)
    flat_r, treedef = jax.tree_util.tree_flatten(tree, is_leaf=is_empty_node)
    out = []
    for t, r in zip(flat_t, flat_r, strict=True):
        fmt = arrays_sharding.get_sharding_or_format(t, support_format=True) if hasattr(t, "sharding") else None
        out.append(jax.device_put(r, fmt) if isinstance(fmt, arrays_sharding.Format) and isinstance(r, jax.Array) else r)
    return jax.tree_util.tree_unflatten(treedef, out)


def saved_sharding(saved: SavedStep, leaf: SavedLeaf, fallback: Any) -> Any:
    """The jax sharding a leaf was saved with, rebuilt on this job's devices; `fallback`
    where they cannot hold it; else Orbax's error."""
    assert leaf.sharding is not None
    try:
        return sharding_metadata.from_serialized_string(leaf.sharding).to_jax_sharding()
    except (ValueError, KeyError, IndexError, TypeError) as e:
        if fallback is not None:
            return fallback
        raise OrbaxValueError(
            f"Topology mismatch detected: step {saved.step} '{saved.put}' leaf {leaf.key} was saved in a sharding this "
            f"job's {jax.device_count()} devices cannot hold ({e}); pass Restore(target) with the shardings to "
            "restore into (any mesh), or Restore(fallback_sharding=...)"
        ) from None


def default_target(saved: SavedStep, leaf: SavedLeaf, fallback: Any) -> Any:
    """What a leaf restores into without a target: a jax.Array in its saved sharding (its key
    data's, for PRNG keys); None (a numpy array, or the saved value) for the rest."""
    if leaf.type != "jax" or leaf.sharding is None:
        return None
    sharding = saved_sharding(saved, leaf, fallback)
    if leaf.prng_impl is not None:
        sharding = _key_data_sharding(sharding, len(leaf.key_shape), len(leaf.shape) - len(leaf.key_shape))
    return jax.ShapeDtypeStruct(leaf.shape, _dtypes.numpy_dtype(leaf.dtype), sharding=sharding)


def _leaf_metadata(leaf: SavedLeaf, directory: epath.Path) -> Any:
    if leaf.type in ("jax", "numpy"):
        sharding = sharding_metadata.from_serialized_string(leaf.sharding) if leaf.sharding else None
        shape, dtype = leaf.shape, _dtypes.numpy_dtype(leaf.dtype)
        if leaf.prng_impl is not None:
            shape = leaf.key_shape
            dtype = jax.eval_shape(lambda: jax.random.key(0, impl=leaf.prng_impl)).dtype
        if leaf.scalar:
            return value_metadata.ScalarMetadata(name=leaf.key, directory=directory, dtype=dtype)
        return value_metadata.ArrayMetadata(name=leaf.key, directory=directory, shape=tuple(shape), sharding=sharding,
                                            dtype=dtype)
    if leaf.type == "python" and isinstance(leaf.value, str):
        return value_metadata.StringMetadata(name=leaf.key, directory=directory)
    if leaf.type == "python" and isinstance(leaf.value, (bool, int, float)):
        return value_metadata.ScalarMetadata(name=leaf.key, directory=directory, dtype=np.dtype(type(leaf.value)))
    return leaf.value  # None, empty subtrees, and the values tiercel stores that Orbax has no metadata for


def metadata_tree(leaves: list[SavedLeaf], custom_metadata: Any, directory: epath.Path) -> Any:
    """Orbax's TreeMetadata of a saved item (nested dicts and lists, as Orbax's is)."""
    tree = nested(leaves, [_leaf_metadata(leaf, epath.Path(directory)) for leaf in leaves])
    if not isinstance(tree, (dict, list, tuple)):
        tree = {"": tree} if tree is not None else {}
    return tree_metadata.build_default_tree_metadata(tree, custom_metadata=custom_metadata)
