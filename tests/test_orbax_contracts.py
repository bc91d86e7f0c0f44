"""What Orbax's StandardCheckpointHandler promises, kept by tiercel.orbax's handler: each
case mirrors one of Orbax's own `standard_checkpoint_handler_test` cases (named in its
docstring), with real JAX on 8 CPU devices in this process (every other test runs JAX in a
child process, so this module sets the device count before JAX starts).

Casting on save (SaveArgs(dtype=)), Orbax's metadata object and custom metadata, restoring
without a target into the saved shardings (and "Topology mismatch detected" where they
cannot be rebuilt), strict=False into another shape, masked and partial restores, empty
subtrees, typed PRNG keys, custom layouts (support_layout).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any
from unittest import mock

import numpy as np
import pytest

os.environ.setdefault("JAX_PLATFORMS", "cpu")
jax = pytest.importorskip("jax")
ocp = pytest.importorskip("orbax.checkpoint")
jax.config.update("jax_num_cpu_devices", 8)

import jax.numpy as jnp  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402
from orbax.checkpoint._src.metadata import sharding as sharding_metadata  # noqa: E402
from orbax.checkpoint._src.metadata import tree as tree_metadata  # noqa: E402

import tiercel  # noqa: E402
import tiercel.orbax  # noqa: E402
from tiercel.orbax import Restore, Save, TiercelCheckpointHandler  # noqa: E402

from conftest import make_policy  # noqa: E402


class MaskedNode(tuple):
    """optax.MaskedNode's shape (an empty NamedTuple: a pytree node with no leaves),
    without needing optax."""

    def __new__(cls) -> MaskedNode:
        return super().__new__(cls, ())


jax.tree_util.register_pytree_node(MaskedNode, lambda _: ((), None), lambda _, __: MaskedNode())


def sharded(x: np.ndarray, mesh: Mesh, spec: P) -> jax.Array:
    return jax.make_array_from_callback(x.shape, NamedSharding(mesh, spec), lambda idx: x[idx])


def numpy_tree() -> dict[str, Any]:
    """Orbax's test_utils.setup_pytree."""
    return {"a": np.arange(8) * 1, "b": np.arange(16) * 2,
            "c": {"a": np.arange(8).reshape((2, 4)) * 3, "e": np.arange(16).reshape((4, 4)) * 4}}


def sharded_tree(tree: dict[str, Any]) -> dict[str, Any]:
    """Orbax's test_utils.setup_sharded_pytree: replicated, 1-d, 2-d meshes."""
    devices = np.asarray(jax.devices())
    m1, m2 = Mesh(devices, ("x",)), Mesh(devices.reshape((2, 4)), ("x", "y"))
    return {"a": sharded(tree["a"], m1, P(None)), "b": sharded(tree["b"], m1, P("x")),
            "c": {"a": sharded(tree["c"]["a"], m2, P("x", "y")), "e": sharded(tree["c"]["e"], m2, P("x", "y"))}}


def abstract(tree: Any) -> Any:
    return jax.tree.map(ocp.utils.to_shape_dtype_struct, tree)


def assert_same(expected: Any, actual: Any) -> None:
    """Orbax's test_utils.assert_tree_equal: the same keys, types, dtypes, shards, values."""
    fe, te = jax.tree_util.tree_flatten_with_path(expected, is_leaf=lambda x: x is None)
    fa, ta = jax.tree_util.tree_flatten_with_path(actual, is_leaf=lambda x: x is None)
    assert te == ta, (te, ta)
    for (path, e), (_, a) in zip(fe, fa):
        where = jax.tree_util.keystr(path)
        assert isinstance(a, type(e)), (where, type(e), type(a))
        if isinstance(e, jax.Array) and jax.dtypes.issubdtype(e.dtype, jax.dtypes.prng_key):
            assert str(jax.random.key_impl(e)) == str(jax.random.key_impl(a)), where
            e, a = jax.random.key_data(e), jax.random.key_data(a)
        if isinstance(e, jax.Array):
            assert e.dtype == a.dtype and a.sharding.is_equivalent_to(e.sharding, e.ndim), (where, e.sharding, a.sharding)
            for se, sa in zip(e.addressable_shards, a.addressable_shards, strict=True):
                np.testing.assert_array_equal(sa.data, se.data, err_msg=where)
        elif isinstance(e, np.ndarray):
            assert e.dtype == a.dtype, where
            np.testing.assert_array_equal(a, e, err_msg=where)
        else:
            assert e == a, where


@pytest.fixture
def handler(shm_root: str):
    h = TiercelCheckpointHandler(make_policy(shm_root, None))
    yield h
    h.close()


@pytest.fixture
def item_dir(tmp_path: Path) -> Path:
    """An Orbax item directory of step 1 (Orbax creates it before the handler saves)."""
    d = tmp_path / "1" / "state"
    d.mkdir(parents=True)
    return d


def test_restore_without_a_target_gives_arrays_in_their_saved_shardings(handler, item_dir):
    """test_basic, test_basic_no_item_arg: as Orbax, not global numpy arrays."""
    tree = sharded_tree(numpy_tree())
    handler.save(item_dir, Save(tree))
    assert_same(tree, handler.restore(item_dir, Restore(jax.tree.map(jnp.zeros_like, tree))))
    assert_same(tree, handler.restore(item_dir))
    mixed = {"sharded": tree, "numpy": {**numpy_tree(), "x": 4.5, "y": 3}}
    d = item_dir.parent.parent / "2" / "state"
    d.mkdir(parents=True)
    handler.save(d, Save(mixed))
    assert_same(mixed, handler.restore(d, Restore(abstract(mixed))))  # test_shape_dtype_struct
    assert_same(mixed, handler.restore(d))


def test_a_topology_that_cannot_hold_the_saved_sharding_is_orbaxs_error(handler, item_dir):
    """test_topology_mismatch: without a target, on fewer devices than the save's mesh."""
    arr = sharded(np.zeros(8), Mesh(np.asarray(jax.devices()), ("x",)), P("x"))
    handler.save(item_dir, Save({"a": arr}))
    one = jax.devices()[:1]
    with mock.patch.object(jax, "devices", return_value=one):
        with pytest.raises(ValueError, match="Topology mismatch detected") as e:
            handler.restore(item_dir)
        assert isinstance(e.value, tiercel.InvalidArgumentError) and "leaf ['a']" in str(e.value)
        # Orbax's fallback_sharding, or a target, restores it anywhere.
        fallback = jax.sharding.SingleDeviceSharding(one[0])
        got = handler.restore(item_dir, Restore(fallback_sharding=fallback))["a"]
    assert got.sharding == fallback and np.array_equal(np.asarray(got), np.zeros(8))


def test_save_args_dtype_casts_and_metadata_says_so(handler, item_dir):
    """test_cast: saved as float32, restored into bfloat16."""
    tree = sharded_tree(numpy_tree())
    save_args = jax.tree.map(lambda _: ocp.SaveArgs(dtype=jnp.dtype(jnp.float32)), tree)
    handler.save(item_dir, Save(tree, save_args=save_args))
    meta = handler.metadata(item_dir)
    jax.tree.map(lambda m: (m.dtype == jnp.float32) or pytest.fail(f"{m}"), meta)
    target = jax.tree.map(lambda x: ocp.utils.to_shape_dtype_struct(x, dtype=jnp.bfloat16), tree)
    restored = handler.restore(item_dir, Restore(target))
    for got, want in zip(jax.tree.leaves(restored), jax.tree.leaves(tree)):
        assert got.dtype == jnp.bfloat16 and np.array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))
    with pytest.raises(ValueError, match="aggregate"):
        handler.save(item_dir, Save(tree, save_args=jax.tree.map(lambda _: ocp.SaveArgs(aggregate=True), tree)))


def test_metadata_is_orbaxs_tree_metadata_with_custom_metadata(handler, item_dir):
    """test_custom_metadata; and the metadata object's leaves (ArrayMetadata with the saved
    sharding, ScalarMetadata, StringMetadata)."""
    tree = {**sharded_tree(numpy_tree()), "n": 3, "s": "text"}
    handler.save(item_dir, Save(tree, custom_metadata={"foo": 1, "bar": [1, "x"]}))
    meta = handler.metadata(item_dir)
    assert isinstance(meta, tree_metadata.TreeMetadata) and meta.custom_metadata == {"foo": 1, "bar": [1, "x"]}
    w = meta["c"]["e"]
    assert isinstance(w, ocp.metadata.ArrayMetadata) and w.shape == (4, 4) and w.dtype == tree["c"]["e"].dtype
    assert w.sharding == sharding_metadata.from_jax_sharding(tree["c"]["e"].sharding)
    assert isinstance(meta["n"], ocp.metadata.ScalarMetadata) and isinstance(meta["s"], ocp.metadata.StringMetadata)
    d = item_dir.parent.parent / "2" / "state"
    d.mkdir(parents=True)
    handler.save(d, Save(tree))
    assert handler.metadata(d).custom_metadata is None


@pytest.mark.parametrize("size", [4, 12])
def test_strict_false_restores_into_another_size(handler, item_dir, size):
    """test_change_shape: strict (the default) refuses; strict=False cuts or pads with zeros."""
    mesh = Mesh(np.asarray(jax.devices()), ("x",))
    handler.save(item_dir, Save({"x": sharded(np.arange(8), mesh, P(None)), "y": sharded(np.arange(16), mesh, P("x"))}))
    want = np.zeros(size, np.int32)  # JAX without x64: int32 arrays
    want[:min(size, 8)] = np.arange(8)[:size]
    target = {"x": jax.ShapeDtypeStruct((size,), jnp.int32, sharding=NamedSharding(mesh, P(None))),
              "y": jax.ShapeDtypeStruct((16,), jnp.int32, sharding=NamedSharding(mesh, P("x")))}
    with pytest.raises(tiercel.InvalidArgumentError, match="strict=False"):
        handler.restore(item_dir, Restore(target))
    got = handler.restore(item_dir, Restore(target, strict=False))
    assert got["x"].shape == (size,) and np.array_equal(np.asarray(got["x"]), want)
    assert np.array_equal(np.asarray(got["y"]), np.arange(16))
    # Sharded across the devices too: each device's box cut or padded.
    four = NamedSharding(Mesh(np.asarray(jax.devices()[:4]), ("x",)), P("x"))
    sharded_target = {"x": jax.ShapeDtypeStruct((size,), jnp.int32, sharding=four)}
    assert np.array_equal(np.asarray(handler.restore(item_dir, Restore(sharded_target, strict=False))["x"]), want)


def test_masked_leaves_restore_as_none(handler, item_dir):
    """test_masked_shape_dtype_struct: a leaf saved as optax.MaskedNode() restores as None
    with the full target and without one; the masked target keeps its MaskedNode()s (as an
    optax state keeps its EmptyState()s)."""
    tree = sharded_tree(numpy_tree())

    def masked(path: Any) -> bool:
        return path[0].key == "a" or (path[0].key == "c" and path[1].key == "e")

    masked_tree = jax.tree_util.tree_map_with_path(lambda p, x: MaskedNode() if masked(p) else x, tree)
    expected = jax.tree_util.tree_map_with_path(lambda p, x: None if masked(p) else x, tree)
    handler.save(item_dir, Save(masked_tree))
    assert_same(expected, handler.restore(item_dir, Restore(abstract(tree))))
    assert_same(masked_tree, handler.restore(item_dir, Restore(abstract(masked_tree))))
    assert_same(expected, handler.restore(item_dir))


def test_a_partial_target_reads_only_what_it_names(handler, item_dir):
    """test_none_node_in_restore_args: a leaf the target leaves out (None) is not read."""
    mesh = Mesh(np.asarray(jax.devices()), ("x",))
    handler.save(item_dir, Save({"b": sharded(np.arange(16), mesh, P("x")), "c": np.arange(4)}))
    assert handler.restore(item_dir, Restore({"b": None, "c": None})) == {"b": None, "c": None}
    assert handler.last_restore.nbytes == 0
    got = handler.restore(item_dir, Restore({"b": None, "c": np.zeros(4, np.int64)}))
    assert got["b"] is None and np.array_equal(got["c"], np.arange(4))


def test_empty_trees_and_nodes(handler, item_dir):
    """test_empty_error, test_empty_dict_node, test_empty_none_node."""
    with pytest.raises(ValueError, match="no leaves"):
        handler.save(item_dir, Save({}))
    for item in ({"a": {}, "b": 3}, {"c": None, "d": 2}, {"e": [], "f": (), "g": 1.5}):
        handler.save(item_dir, Save(item))
        assert handler.restore(item_dir, Restore(item)) == item
        assert handler.restore(item_dir) == item


def test_typed_prng_keys_round_trip(handler, item_dir):
    """test_with_random_keys, test_save_restore_random_keys_with_jax_eval_shape: threefry and
    rbg keys, restored into a concrete target, ShapeDtypeStructs, jax.eval_shape, no target."""
    replicated = NamedSharding(Mesh(np.asarray(jax.devices()), ("x",)), P())

    def keys(seed: int) -> dict[str, jax.Array]:
        return {"rand_orig": jax.random.key(jnp.array(seed, device=replicated)),
                "rand_rbg": jax.random.key(jnp.array(seed, device=replicated), impl="rbg"),
                "split": jax.device_put(jax.random.split(jax.random.key(seed), 8),
                                        NamedSharding(replicated.mesh, P("x")))}

    tree = {**sharded_tree(numpy_tree()), **keys(1)}
    handler.save(item_dir, Save(tree))
    zeros = {**sharded_tree(jax.tree.map(np.zeros_like, numpy_tree())), **keys(0)}
    assert_same(tree, handler.restore(item_dir, Restore(zeros)))
    assert_same(tree, handler.restore(item_dir, Restore(abstract(zeros))))
    assert_same(tree, handler.restore(item_dir, Restore(jax.eval_shape(lambda: zeros))))
    assert_same(tree, handler.restore(item_dir))
    meta = handler.metadata(item_dir)
    assert meta["split"].shape == (8,) and jax.dtypes.issubdtype(meta["split"].dtype, jax.dtypes.prng_key)

    @jax.jit
    def state(root: jax.Array) -> dict[str, jax.Array]:
        return {"matrix": jnp.array([[1, 2], [3, 4], [5, 6], [7, 8]]), "rngkey": jax.random.fold_in(root, 42)}

    d = item_dir.parent.parent / "2" / "state"
    d.mkdir(parents=True)
    handler.save(d, Save(state(jax.random.key(0))))
    assert_same(state(jax.random.key(0)), handler.restore(d, Restore(jax.eval_shape(state, jax.random.key(0)))))


def test_support_layout_restores_into_the_targets_layout(handler, item_dir):
    """test_custom_layout: a target with another device-local layout (Format)."""
    from orbax.checkpoint._src.arrays import sharding as arrays_sharding

    arr = sharded(np.arange(32).reshape(8, 4), Mesh(np.asarray(jax.devices()).reshape(4, 2), ("x", "y")), P("x", "y"))
    handler.save(item_dir, Save({"x": arr}))
    layout = arrays_sharding.get_device_local_layout(arr)
    custom = arrays_sharding.Format(arrays_sharding.DLL(major_to_minor=layout.major_to_minor[::-1], tiling=layout.tiling),
                                    sharding=arr.sharding)
    arr_new = jax.device_put(arr, custom)
    assert arr_new.format != arr.format
    got = handler.restore(item_dir, Restore({"x": arr_new}, support_layout=True))["x"]
    assert got.format == arr_new.format and np.array_equal(np.asarray(got), np.asarray(arr))
    got = handler.restore(item_dir, Restore({"x": jax.ShapeDtypeStruct(arr.shape, arr.dtype, sharding=custom)},
                                            support_layout=True))["x"]
    assert got.format == arr_new.format
    assert handler.restore(item_dir, Restore({"x": arr_new}))["x"].format == arr.format  # support_layout=False
