"""Tests for fedbayes.tree: client-axis reductions, size accounting, stacking.

Inputs and expectations are built with numpy: every eager JAX op on a new shape costs an XLA
compile, and those compiles, not the arithmetic, set the run time.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fedbayes import tree as ftree

NUM = 3  # clients on the leading axis; one size throughout so eager compiles are shared


def _stacked(seed, dtype=np.float32):
    rng = np.random.default_rng(seed)
    return {
        "w": jnp.asarray(rng.normal(size=(NUM, 2)).astype(dtype)),
        "b": [jnp.asarray(rng.normal(size=(NUM, 2, 2)).astype(dtype))],
        "s": jnp.asarray(rng.normal(size=(NUM,)).astype(dtype)),
    }


def test_weighted_sum_matches_numpy():
    stacked = _stacked(0)
    weights = jnp.asarray(np.asarray([0.5, 2.0, -1.0], np.float32))
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
            "f32": jnp.asarray(np.ones((3, 2), np.float32)),
            "bf16": jnp.asarray(np.ones((3,), np.float32)).astype(jnp.bfloat16),
            "f64": jnp.asarray(np.ones((3, 1), np.float64)),
        }
        weights = jnp.asarray(np.asarray([1.0, 2.0, 3.0], np.float64))

        @jax.jit
        def both(stacked, weights):
            return ftree.weighted_sum(stacked, weights), ftree.weighted_mean(stacked, weights)

        # Traced under strict promotion: no implicit float64 promotion may happen.
        with jax.numpy_dtype_promotion("strict"):
            total, mean = both(stacked, weights)
        for out in (total, mean):
            assert out["f32"].dtype == jnp.float32
            assert out["bf16"].dtype == jnp.bfloat16
            assert out["f64"].dtype == jnp.float64
        np.testing.assert_array_equal(total["f32"], [6.0, 6.0])
        np.testing.assert_array_equal(mean["f64"], [1.0])


def test_zero_weight_entries_are_absent_even_if_not_finite():
    stacked = {"a": jnp.asarray([[1.0, 2.0], [np.nan, np.inf], [3.0, 4.0]])}
    weights = jnp.asarray([1.0, 0.0, 1.0])
    np.testing.assert_array_equal(ftree.weighted_sum(stacked, weights)["a"], [4.0, 6.0])
    np.testing.assert_array_equal(ftree.weighted_mean(stacked, weights)["a"], [2.0, 3.0])


def test_weighted_mean_matches_numpy_average():
    stacked = _stacked(1)
    weights = jnp.asarray(np.asarray([3.0, 0.0, 7.0], np.float32))
    got = ftree.weighted_mean(stacked, weights)
    want = jax.tree.map(lambda x: np.average(np.asarray(x), axis=0, weights=np.asarray(weights)), stacked)
    # float32 accumulation order differs from numpy's.
    jax.tree.map(lambda g, w: np.testing.assert_allclose(g, w, rtol=1e-6, atol=1e-6), got, want)


@pytest.mark.parametrize("weights", [[0.0, 0.0, 0.0], [1.0, -1.0, 0.0]])
def test_weighted_mean_zero_total_gives_zeros(weights):
    stacked = {"a": jnp.asarray(np.arange(6.0).reshape(3, 2) + 1.0)}
    out = jax.jit(ftree.weighted_mean)(stacked, jnp.asarray(weights))
    np.testing.assert_array_equal(out["a"], [0.0, 0.0])


def test_weighted_reductions_validate_shapes():
    stacked = {"a": np.ones((3, 2), np.float32)}
    with pytest.raises(ValueError, match="leading axis"):
        ftree.weighted_sum(stacked, np.ones((4,), np.float32))
    with pytest.raises(ValueError, match="vector"):
        ftree.weighted_mean(stacked, np.ones((3, 1), np.float32))
    with pytest.raises(ValueError, match="leading axis"):
        ftree.weighted_sum({"s": np.ones((), np.float32)}, np.ones((1,), np.float32))


def test_weighted_reductions_under_jit_and_vmap():
    stacked = _stacked(2)
    weights = jnp.asarray(np.asarray([1.0, 0.0, 0.5], np.float32))
    eager = (ftree.weighted_sum(stacked, weights), ftree.weighted_mean(stacked, weights))
    both = jax.jit(lambda s, w: (ftree.weighted_sum(s, w), ftree.weighted_mean(s, w)))
    # XLA may fuse and reorder the float32 reduction.
    jax.tree.map(
        lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6),
        both(stacked, weights),
        eager,
    )
    # vmap over an outer batch of two rounds (under jit: one compile, not one per primitive).
    batched = jax.tree.map(lambda x: jnp.asarray(np.stack([np.asarray(x), 2 * np.asarray(x)])), stacked)
    out = jax.jit(jax.vmap(both, in_axes=(0, None)))(batched, weights)
    for got, want in zip(out, eager, strict=True):
        # Same float32 reductions, possibly reordered by vmap.
        jax.tree.map(lambda o, e: np.testing.assert_allclose(o[0], e, rtol=1e-6, atol=1e-6), got, want)
        jax.tree.map(lambda o, e: np.testing.assert_allclose(o[1], 2 * e, rtol=1e-6, atol=1e-6), got, want)


def test_num_params_and_tree_bytes_golden():
    tree = {
        "w": jnp.asarray(np.zeros((3, 4), np.float32)),
        "b": np.zeros((5,), np.int8),
        "h": [jnp.asarray(np.zeros((2, 2), np.float32)).astype(jnp.bfloat16)],
        "s": jnp.asarray(np.zeros((), np.float32)),
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

    f({"a": np.ones((2, 3), np.float32), "b": np.ones(4, np.float32)})
    assert seen == [10]


def test_all_finite():
    ones = np.ones((2, 2), np.float32)
    good = {
        "a": jnp.asarray(ones),
        "b": [jnp.asarray(np.zeros(3, np.float32)), jnp.asarray(np.arange(3))],
    }
    assert bool(ftree.all_finite(good))
    assert bool(ftree.all_finite({}))
    for bad_value in (np.nan, np.inf, -np.inf):
        bad_leaf = ones.copy()
        bad_leaf[1, 0] = bad_value
        bad = {"a": jnp.asarray(bad_leaf), "b": good["b"]}
        assert not bool(ftree.all_finite(bad))
        assert not bool(jax.jit(ftree.all_finite)(bad))
    assert ftree.all_finite(good).shape == ()
    assert ftree.all_finite(good).dtype == jnp.bool_


def test_stack_unstack_round_trip():
    trees = [
        {
            "a": jnp.asarray(np.full((2,), float(i))),
            "b": (jnp.asarray(i), jnp.asarray(np.full((1, 3), i))),
        }
        for i in range(3)
    ]
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
        ftree.unstack({"a": np.ones((3, 2))}, 2)
    with pytest.raises(ValueError, match="infer"):
        ftree.unstack({"a": np.ones((3, 2)), "b": np.ones((2,))})


def test_ravel_round_trip():
    tree = {"w": jnp.asarray(np.arange(6.0).reshape(2, 3)), "b": [jnp.asarray([7.0, 8.0])]}
    flat, unravel = ftree.ravel(tree)
    assert flat.shape == (8,)
    np.testing.assert_array_equal(np.sort(np.asarray(flat)), np.arange(9.0)[np.arange(9) != 6])
    back = unravel(flat)
    jax.tree.map(np.testing.assert_array_equal, back, tree)
    assert ftree.ravel is jax.flatten_util.ravel_pytree
