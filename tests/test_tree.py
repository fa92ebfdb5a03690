"""Tests for fedbayes.tree: client-axis reductions, size accounting, stacking."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fedbayes import tree as ftree


def _stacked(rng, num, dtype=np.float32):
    return {
        "w": jnp.asarray(rng.normal(size=(num, 3, 2)).astype(dtype)),
        "b": [jnp.asarray(rng.normal(size=(num, 2)).astype(dtype))],
        "s": jnp.asarray(rng.normal(size=(num,)).astype(dtype)),
    }


def test_weighted_sum_matches_numpy():
    rng = np.random.default_rng(0)
    stacked = _stacked(rng, 4)
    weights = jnp.asarray([0.5, 2.0, -1.0, 3.0], dtype=jnp.float32)
    got = ftree.weighted_sum(stacked, weights)
    want = jax.tree.map(lambda x: np.einsum("m,m...->...", np.asarray(weights), np.asarray(x)), stacked)
    assert jax.tree.structure(got) == jax.tree.structure(stacked)
    # float32 accumulation order differs from numpy's einsum.
    jax.tree.map(lambda g, w: np.testing.assert_allclose(g, w, rtol=1e-6, atol=1e-6), got, want)
    jax.tree.map(lambda g, x: np.testing.assert_equal(g.shape, x.shape[1:]), got, stacked)


def test_weighted_sum_golden():
    stacked = {"a": jnp.asarray([[1.0, 2.0], [10.0, 20.0], [100.0, 200.0]])}
    got = ftree.weighted_sum(stacked, jnp.asarray([1.0, 0.5, 0.0]))
    np.testing.assert_array_equal(got["a"], [6.0, 12.0])


def test_weighted_sum_keeps_leaf_dtype():
    with jax.enable_x64(True):
        stacked = {
            "f32": jnp.ones((3, 2), jnp.float32),
            "bf16": jnp.ones((3,), jnp.bfloat16),
            "f64": jnp.ones((3, 1), jnp.float64),
        }
        weights = jnp.asarray([1.0, 2.0, 3.0], dtype=jnp.float64)
        for fn in (ftree.weighted_sum, ftree.weighted_mean):
            out = fn(stacked, weights)
            assert out["f32"].dtype == jnp.float32
            assert out["bf16"].dtype == jnp.bfloat16
            assert out["f64"].dtype == jnp.float64
        np.testing.assert_array_equal(ftree.weighted_sum(stacked, weights)["f32"], [6.0, 6.0])


def test_zero_weight_entries_are_absent_even_if_not_finite():
    stacked = {"a": jnp.asarray([[1.0, 2.0], [jnp.nan, jnp.inf], [3.0, 4.0]])}
    weights = jnp.asarray([1.0, 0.0, 1.0])
    np.testing.assert_array_equal(ftree.weighted_sum(stacked, weights)["a"], [4.0, 6.0])
    np.testing.assert_array_equal(ftree.weighted_mean(stacked, weights)["a"], [2.0, 3.0])


def test_weighted_mean_matches_numpy_average():
    rng = np.random.default_rng(1)
    stacked = _stacked(rng, 5)
    weights = jnp.asarray([3.0, 1.0, 0.0, 7.0, 2.0], dtype=jnp.float32)
    got = ftree.weighted_mean(stacked, weights)
    want = jax.tree.map(lambda x: np.average(np.asarray(x), axis=0, weights=np.asarray(weights)), stacked)
    # float32 accumulation order differs from numpy's.
    jax.tree.map(lambda g, w: np.testing.assert_allclose(g, w, rtol=1e-6, atol=1e-6), got, want)


@pytest.mark.parametrize("weights", [[0.0, 0.0, 0.0], [1.0, -1.0, 0.0]])
def test_weighted_mean_zero_total_gives_zeros(weights):
    stacked = {"a": jnp.arange(6.0).reshape(3, 2) + 1.0}
    out = jax.jit(ftree.weighted_mean)(stacked, jnp.asarray(weights))
    np.testing.assert_array_equal(out["a"], [0.0, 0.0])


def test_weighted_reductions_validate_shapes():
    stacked = {"a": jnp.ones((3, 2))}
    with pytest.raises(ValueError, match="leading axis"):
        ftree.weighted_sum(stacked, jnp.ones((4,)))
    with pytest.raises(ValueError, match="vector"):
        ftree.weighted_mean(stacked, jnp.ones((3, 1)))
    with pytest.raises(ValueError, match="leading axis"):
        ftree.weighted_sum({"s": jnp.ones(())}, jnp.ones((1,)))


def test_weighted_sum_under_jit_and_vmap():
    rng = np.random.default_rng(2)
    stacked = _stacked(rng, 4)
    weights = jnp.asarray([1.0, 2.0, 0.0, 0.5], dtype=jnp.float32)
    eager = ftree.weighted_mean(stacked, weights)
    jitted = jax.jit(ftree.weighted_mean)(stacked, weights)
    # XLA may fuse and reorder the float32 reduction.
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6), eager, jitted)
    # vmap over an outer batch of two rounds.
    batched = jax.tree.map(lambda x: jnp.stack([x, 2 * x]), stacked)
    out = jax.vmap(ftree.weighted_sum, in_axes=(0, None))(batched, weights)
    single = ftree.weighted_sum(stacked, weights)
    # Same float32 reduction, possibly reordered by vmap.
    jax.tree.map(lambda o, s: np.testing.assert_allclose(o[1], 2 * s, rtol=1e-6, atol=1e-6), out, single)


def test_num_params_and_tree_bytes_golden():
    tree = {
        "w": jnp.zeros((3, 4), jnp.float32),
        "b": np.zeros((5,), np.int8),
        "h": [jnp.zeros((2, 2), jnp.bfloat16)],
        "s": jnp.zeros((), jnp.float32),
    }
    assert ftree.num_params(tree) == 12 + 5 + 4 + 1
    assert ftree.tree_bytes(tree) == 12 * 4 + 5 * 1 + 4 * 2 + 4
    assert isinstance(ftree.num_params(tree), int)
    assert isinstance(ftree.tree_bytes(tree), int)
    shapes = jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), x.dtype), tree)
    assert ftree.num_params(shapes) == ftree.num_params(tree)
    assert ftree.tree_bytes(shapes) == ftree.tree_bytes(tree)
    assert ftree.num_params({}) == 0 and ftree.tree_bytes({}) == 0


def test_num_params_works_on_tracers():
    seen = []

    @jax.jit
    def f(tree):
        seen.append(ftree.num_params(tree))
        return tree

    f({"a": jnp.ones((2, 3)), "b": jnp.ones(4)})
    assert seen == [10]


def test_all_finite():
    good = {"a": jnp.ones((2, 2)), "b": [jnp.zeros(3), jnp.arange(3)]}
    assert bool(ftree.all_finite(good))
    assert bool(ftree.all_finite({}))
    for bad_value in (jnp.nan, jnp.inf, -jnp.inf):
        bad = {"a": jnp.ones((2, 2)).at[1, 0].set(bad_value), "b": [jnp.zeros(3), jnp.arange(3)]}
        assert not bool(ftree.all_finite(bad))
        assert not bool(jax.jit(ftree.all_finite)(bad))
    assert ftree.all_finite(good).shape == ()
    assert ftree.all_finite(good).dtype == jnp.bool_


def test_stack_unstack_round_trip():
    trees = [{"a": jnp.full((2,), float(i)), "b": (jnp.asarray(i), jnp.ones((1, 3)) * i)} for i in range(3)]
    stacked = ftree.stack(trees)
    assert stacked["a"].shape == (3, 2)
    assert stacked["b"][0].shape == (3,)
    assert stacked["b"][1].shape == (3, 1, 3)
    np.testing.assert_array_equal(stacked["a"][:, 0], [0.0, 1.0, 2.0])
    for back in (ftree.unstack(stacked, 3), ftree.unstack(stacked)):
        assert len(back) == 3
        for got, want in zip(back, trees, strict=True):
            assert jax.tree.structure(got) == jax.tree.structure(want)
            jax.tree.map(np.testing.assert_array_equal, got, want)


def test_stack_unstack_errors():
    with pytest.raises(ValueError):
        ftree.stack([])
    with pytest.raises(ValueError, match="size 2"):
        ftree.unstack({"a": jnp.ones((3, 2))}, 2)
    with pytest.raises(ValueError, match="infer"):
        ftree.unstack({"a": jnp.ones((3, 2)), "b": jnp.ones((2,))})


def test_ravel_round_trip():
    tree = {"w": jnp.arange(6.0).reshape(2, 3), "b": [jnp.asarray([7.0, 8.0])]}
    flat, unravel = ftree.ravel(tree)
    assert flat.shape == (8,)
    np.testing.assert_array_equal(np.sort(np.asarray(flat)), np.arange(9.0)[np.arange(9) != 6])
    back = unravel(flat)
    jax.tree.map(np.testing.assert_array_equal, back, tree)
    assert ftree.ravel is jax.flatten_util.ravel_pytree
