"""Tests for fedbayes.gaussian_block against dense numpy/scipy linear algebra (float64).

Every operation on Lambda = blockdiag(diag(lambda_R), Lambda_L) is checked against the same
operation on the dense ``[D, D]`` matrix (:func:`fedbayes.gaussian_block.precision_matrix`), over
parameter dicts of several shapes whose last layer comes anywhere in ravel order.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import scipy.stats
from hypothesis import given, settings
from hypothesis import strategies as st
from jax.flatten_util import ravel_pytree

from fedbayes import gaussian as G
from fedbayes import gaussian_block as B
from fedbayes import gaussian_full as F

# the last layer: "output" wherever it sorts in ravel order, or the last entry of a dict without one
STRUCTURES = (
    {"hidden_0": {"kernel": (3, 2), "bias": (2,)}, "output": {"kernel": (2, 2), "bias": (2,)}},
    {"output": {"w": (3,)}, "zeta": {"w": (2,)}},
    {"a": {"w": (2,)}, "b": {"w": (2, 2)}},
)


def _flat(tree):
    return np.asarray(ravel_pytree(jax.tree.map(jnp.asarray, tree))[0])


def _block(rng, shapes, scale=1.0):
    """A proper BlockGaussian (diagonal in [0.5, 2], a random SPD last-layer block) and its dense
    precision and mean."""
    mean = jax.tree.map(lambda s: jnp.asarray(rng.normal(size=s)), shapes, is_leaf=lambda x: isinstance(x, tuple))
    key = B.last_layer_key(mean)
    rest, last = B.split(mean)
    b = _flat(last).size
    m = rng.normal(size=(b, b))
    dense = scale * (m @ m.T / b + 0.5 * np.eye(b))
    prec = B.BlockPrecision(jax.tree.map(lambda x: jnp.asarray(rng.uniform(0.5, 2.0, size=x.shape)), rest), jnp.asarray(dense), key)
    g0 = B.BlockGaussian(mean, prec)  # eta is filled below from the dense matrix
    lam = B.precision_matrix(g0)
    _, unravel = ravel_pytree(mean)
    mu = _flat(mean)
    return B.BlockGaussian(unravel(jnp.asarray(lam @ mu)), prec), lam, mu


cases = st.tuples(st.sampled_from(STRUCTURES), st.integers(0, 2**31 - 1))


def test_last_layer_is_output_else_the_last_entry():
    assert B.last_layer_key({"hidden_0": 1, "output": 2, "z": 3}) == "output"
    assert B.last_layer_key({"b": 1, "a": 2}) == "a"
    with pytest.raises(ValueError, match="dict of layers"):
        B.last_layer_key(jnp.zeros(3))
    rest, last = B.split({"x": 1, "output": 2, "y": 3})
    assert rest == {"x": 1, "y": 3} and last == 2
    assert B.dense_size({"h": jnp.zeros(4), "output": {"k": jnp.zeros((3, 2)), "b": jnp.zeros(2)}}) == 8


@given(cases)
@settings(deadline=None, max_examples=15)
def test_moments_against_dense(case):
    shapes, seed = case
    with jax.enable_x64(True):
        g, lam, mu = _block(np.random.default_rng(seed), shapes)
        cov = np.linalg.inv(lam)
        np.testing.assert_allclose(_flat(B.mean(g)), mu, rtol=1e-8, atol=1e-9)
        np.testing.assert_allclose(_flat(B.variance(g)), np.diag(cov), rtol=1e-8)
        assert bool(B.is_proper(g))
        x = jax.tree.map(lambda m: m + 0.3, B.mean(g))
        xf = _flat(x)
        np.testing.assert_allclose(_flat(B.matvec(g.precision, x)), lam @ xf, rtol=1e-10)
        np.testing.assert_allclose(_flat(B.solve(g.precision, x)), np.linalg.solve(lam, xf), rtol=1e-8)
        np.testing.assert_allclose(float(B.log_prob(g, x)), scipy.stats.multivariate_normal(mu, cov).logpdf(xf), rtol=1e-9)
        np.testing.assert_allclose(float(B.entropy(g)), scipy.stats.multivariate_normal(mu, cov).entropy(), rtol=1e-9)
        shifted = B.shifted(g.precision, 0.7)
        np.testing.assert_allclose(B.precision_matrix(B.BlockGaussian(g.precision_mean, shifted)), lam + 0.7 * np.eye(mu.size), rtol=1e-12)
        jac = np.random.default_rng(seed + 1).normal(size=(3, mu.size))
        np.testing.assert_allclose(np.asarray(B.predictive_variance(g, jnp.asarray(jac))), jac @ cov @ jac.T, rtol=1e-8, atol=1e-10)
        proj = B.project_to_diag(g)
        np.testing.assert_allclose(_flat(G.variance(proj)), np.diag(cov), rtol=1e-8)
        np.testing.assert_allclose(_flat(G.mean(proj)), mu, rtol=1e-8, atol=1e-9)


@given(cases, st.floats(0.0, 1.0))
@settings(deadline=None, max_examples=15)
def test_algebra_against_dense(case, delta):
    shapes, seed = case
    rng = np.random.default_rng(seed)
    with jax.enable_x64(True):
        a, la, _ = _block(rng, shapes)
        b, lb, _ = _block(rng, shapes, scale=0.3)
        ea, eb = _flat(a.precision_mean), _flat(b.precision_mean)
        for got, lam, eta in (
            (B.product(a, b), la + lb, ea + eb),
            (B.quotient(a, b), la - lb, ea - eb),
            (B.difference(a, b), la - lb, ea - eb),
            (B.power(a, 0.3), 0.3 * la, 0.3 * ea),
            (B.damp(a, b, delta), (1 - delta) * la + delta * lb, (1 - delta) * ea + delta * eb),
        ):
            np.testing.assert_allclose(B.precision_matrix(got), lam, rtol=1e-10, atol=1e-12)
            np.testing.assert_allclose(_flat(got.precision_mean), eta, rtol=1e-12, atol=1e-12)
        # the quotient's propriety is the dense matrix's
        q = B.quotient(a, b)
        assert bool(B.is_proper(q)) == bool(np.linalg.eigvalsh(la - lb).min() > 0)
        assert not bool(B.is_proper(B.quotient(b, a)))
        # KL against the closed form on the dense matrices
        ca = np.linalg.inv(la)
        ma, mb = np.linalg.solve(la, ea), np.linalg.solve(lb, eb)
        d = ma.size
        expected = 0.5 * (np.trace(lb @ ca) - d + (ma - mb) @ lb @ (ma - mb) + np.linalg.slogdet(la)[1] - np.linalg.slogdet(lb)[1])
        np.testing.assert_allclose(float(B.kl(a, b)), expected, rtol=1e-8)
        assert abs(float(B.kl(a, a))) < 1e-9


def test_uniform_is_the_identity_of_the_product_and_improper():
    with jax.enable_x64(True):
        g, lam, _ = _block(np.random.default_rng(0), STRUCTURES[0])
        u = B.uniform_like(B.mean(g))
        assert not bool(B.is_proper(u))
        np.testing.assert_array_equal(B.precision_matrix(B.product(g, u)), lam)
        ident = B.scaled_identity(B.mean(g), 2.5)
        np.testing.assert_array_equal(B.precision_matrix(B.BlockGaussian(g.precision_mean, ident)), 2.5 * np.eye(lam.shape[0]))


def test_diagonal_factors_promote_exactly_and_row_bounds_bound_the_curvature():
    with jax.enable_x64(True):
        g, lam, _ = _block(np.random.default_rng(4), STRUCTURES[0])
        diag = G.DiagGaussian(g.precision_mean, jax.tree.map(lambda m: jnp.full_like(m, 1.5), g.precision_mean))
        promoted = B.from_diag(diag)
        np.testing.assert_array_equal(B.precision_matrix(promoted), 1.5 * np.eye(lam.shape[0]))
        np.testing.assert_allclose(B.precision_matrix(B.product(g, diag)), lam + 1.5 * np.eye(lam.shape[0]))
        np.testing.assert_allclose(B.precision_matrix(B.quotient(diag, g)), 1.5 * np.eye(lam.shape[0]) - lam)
        np.testing.assert_allclose(_flat(B.row_bound(g.precision, B.mean(g))), np.abs(lam).sum(axis=1))


def test_mismatched_last_layers_are_refused():
    with jax.enable_x64(True):
        g, _, _ = _block(np.random.default_rng(1), STRUCTURES[2])
        other = B.BlockGaussian(g.precision_mean, B.BlockPrecision(g.precision.diagonal, g.precision.dense, "zz"))
        with pytest.raises(ValueError, match="different last layers"):
            B.product(g, other)
        with pytest.raises(TypeError, match="BlockGaussian"):
            B.product(g, F.uniform_like(g.precision_mean))


def test_draws_have_the_block_covariance():
    with jax.enable_x64(True):
        g, lam, mu = _block(np.random.default_rng(3), STRUCTURES[0])
        draws = B.sample(jax.random.key(0), g, 40_000)
        flat = np.asarray(jax.vmap(lambda t: ravel_pytree(t)[0])(draws))
        cov = np.linalg.inv(lam)
        np.testing.assert_allclose(flat.mean(0), mu, atol=0.05)
        np.testing.assert_allclose(np.cov(flat.T), cov, atol=0.05)
        one = B.sample(jax.random.key(0), g)
        assert jax.tree.structure(one) == jax.tree.structure(B.mean(g))


def test_draws_by_scales_have_the_scales_covariance():
    with jax.enable_x64(True):
        g, lam, mu = _block(np.random.default_rng(5), STRUCTURES[0])
        rest, last = B.split(B.mean(g))
        b = ravel_pytree(last)[0].size
        root = np.tril(np.random.default_rng(6).normal(size=(b, b)))
        scale = B.BlockScale(jax.tree.map(lambda x: jnp.full_like(x, 0.5), rest), jnp.asarray(root), g.precision.key)
        draws = B.sample_scaled(jax.random.key(1), scale, B.mean(g), 40_000)
        assert jax.tree.structure(jax.tree.map(lambda x: x[0], draws)) == jax.tree.structure(B.mean(g))
        r, l = B.split(draws)
        np.testing.assert_allclose(np.cov(np.asarray(jax.vmap(lambda t: ravel_pytree(t)[0])(l)).T), root @ root.T, atol=0.06 * np.abs(root @ root.T).max())
        np.testing.assert_allclose(np.asarray(jax.vmap(lambda t: ravel_pytree(t)[0])(r)).std(0), 0.5, rtol=0.03)


def test_under_jit_and_vmap():
    g, _, _ = _block(np.random.default_rng(2), STRUCTURES[0])
    g = jax.tree.map(lambda x: x.astype(jnp.float32), g)
    stacked = jax.tree.map(lambda x: jnp.stack([x, 2 * x]), g)
    means = jax.jit(jax.vmap(B.mean))(stacked)
    np.testing.assert_allclose(_flat(jax.tree.map(lambda x: x[0], means)), _flat(B.mean(g)), rtol=1e-4)
    np.testing.assert_allclose(_flat(jax.tree.map(lambda x: x[1], means)), _flat(B.mean(g)), rtol=1e-4)
