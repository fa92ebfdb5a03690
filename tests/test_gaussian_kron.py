"""Tests for fedbayes.gaussian_kron against dense numpy linear algebra (float64).

Every operation on Lambda = U diag(s) U^T, U block-diagonal over the leaves with a Kronecker
product L kron R per dense or conv layer, is checked against the same operation on the dense
matrix, over layer shapes and random orthonormal bases.
"""

import jax
import jax.numpy as jnp
import numpy as np
import scipy.linalg
import scipy.stats
from hypothesis import given
from hypothesis import strategies as st
from jax.flatten_util import ravel_pytree

from fedbayes import gaussian_kron as K

# parameter trees as fedbayes's models name them: a dense layer, a conv layer, and a leaf of neither
STRUCTURES = (
    {"dense": {"kernel": (3, 2), "bias": (2,)}},
    {"conv": {"kernel": (2, 2, 1, 2), "bias": (2,)}, "output": {"kernel": (4, 3)}},
    {"dense": {"kernel": (2, 1), "bias": (1,)}, "scale": (3,)},
)


def _params(shapes):
    if isinstance(shapes, dict):
        return {k: _params(v) for k, v in shapes.items()}
    return jnp.zeros(shapes)


def _flat(tree):
    return np.asarray(ravel_pytree(tree)[0])


def _random_bases(rng, params):
    """Random orthonormal sides where :func:`identity_bases` has a side."""
    identity = K.identity_bases(params)

    def side(m):
        return None if m is None else jnp.asarray(np.linalg.qr(rng.normal(size=m.shape))[0])

    return jax.tree.map(lambda b: K.KronBasis(side(b.left), side(b.right)), identity, is_leaf=lambda b: isinstance(b, K.KronBasis))


def _dense_u(params, bases):
    """``U`` built directly: per leaf ``kron(L or I, R or I)``, block-diagonal in ravel order."""
    blocks = []
    for leaf, b in zip(jax.tree.leaves(params), jax.tree.leaves(bases, is_leaf=lambda b: isinstance(b, K.KronBasis)), strict=True):
        n = leaf.shape[-1] if leaf.ndim else 1
        m = leaf.size // n
        left = np.eye(m) if b.left is None else np.asarray(b.left)
        right = np.eye(n) if b.right is None else np.asarray(b.right)
        blocks.append(np.kron(left, right))
    return scipy.linalg.block_diag(*blocks)


cases = st.tuples(st.sampled_from(STRUCTURES), st.integers(0, 2**31 - 1))


def _case(shapes, seed):
    rng = np.random.default_rng(seed)
    params = _params(shapes)
    bases = _random_bases(rng, params)
    u = _dense_u(params, bases)
    _, unravel = ravel_pytree(params)
    return rng, params, bases, u, unravel


def _factor(rng, u, unravel):
    s = rng.uniform(0.5, 2.0, size=u.shape[0])
    lam = (u * s) @ u.T
    mu = rng.normal(size=u.shape[0])
    return K.KronGaussian(unravel(jnp.asarray(lam @ mu)), unravel(jnp.asarray(s))), lam, mu


@given(cases)
def test_moments_draws_and_densities_against_dense(case):
    shapes, seed = case
    with jax.enable_x64(True):
        rng, params, bases, u, unravel = _case(shapes, seed)
        np.testing.assert_allclose(np.asarray(K.dense_rotation(params, bases)), u, atol=1e-14)
        np.testing.assert_allclose(u.T @ u, np.eye(len(u)), atol=1e-12)
        family = K.in_bases(bases)
        g, lam, mu = _factor(rng, u, unravel)
        np.testing.assert_allclose(np.asarray(family.precision_matrix(g.precision)), lam, rtol=1e-10, atol=1e-12)
        cov = np.linalg.inv(lam)
        np.testing.assert_allclose(_flat(family.mean(g)), mu, rtol=1e-8, atol=1e-10)
        np.testing.assert_allclose(_flat(family.variance(g)), np.diag(cov), rtol=1e-8)
        assert bool(family.is_proper(g))
        x = rng.normal(size=len(u))
        xt = unravel(jnp.asarray(x))
        np.testing.assert_allclose(_flat(K.rotate(xt, bases)), u.T @ x, atol=1e-12)
        np.testing.assert_allclose(_flat(K.unrotate(K.rotate(xt, bases), bases)), x, atol=1e-12)
        np.testing.assert_allclose(_flat(family.matvec(g.precision, xt)), lam @ x, rtol=1e-10, atol=1e-12)
        np.testing.assert_allclose(_flat(family.solve(g.precision, xt)), cov @ x, rtol=1e-8, atol=1e-10)
        np.testing.assert_allclose(float(family.quad(g.precision, xt)), x @ lam @ x, rtol=1e-10)
        assert np.all(_flat(family.row_bound(g.precision, params)) >= np.abs(lam).sum(axis=1) - 1e-10)
        np.testing.assert_allclose(float(family.log_prob(g, xt)), scipy.stats.multivariate_normal(mu, cov).logpdf(x), rtol=1e-8)
        diag = family.project_to_diag(g)
        np.testing.assert_allclose(_flat(diag.precision), 1.0 / np.diag(cov), rtol=1e-8)
        np.testing.assert_allclose(_flat(diag.precision_mean), mu / np.diag(cov), rtol=1e-8, atol=1e-10)
        draws = np.asarray(jax.vmap(lambda t: ravel_pytree(t)[0])(family.sample(jax.random.key(seed % 1000), g, 20_000)))
        np.testing.assert_allclose(draws.mean(axis=0), mu, atol=6 * np.sqrt(np.diag(cov).max() / 20_000))
        np.testing.assert_allclose(np.cov(draws.T), cov, atol=0.08 * np.abs(cov).max())
        # the zero-mean spread, and its marginal over one layer: that layer's blocks, the rest at 0
        spread = K.KronSpread(g.precision, bases)
        spread_draws = K.sample_spread(jax.random.key(1), spread, 20_000)
        flat = np.asarray(jax.vmap(lambda t: ravel_pytree(t)[0])(spread_draws))
        np.testing.assert_allclose(np.cov(flat.T), cov, atol=0.08 * np.abs(cov).max())
        layer = next(iter(params))
        layer_draws = K.sample_spread(jax.random.key(1), K.marginal(spread, layer), 3)
        for k, v in layer_draws.items():
            assert (np.abs(np.asarray(jax.tree.leaves(v)[0])).max() > 0) == (k == layer)


@given(cases)
def test_products_quotients_damping_and_kl_against_dense(case):
    shapes, seed = case
    with jax.enable_x64(True):
        rng, params, bases, u, unravel = _case(shapes, seed)
        family = K.in_bases(bases)
        a, lam_a, mu_a = _factor(rng, u, unravel)
        b, lam_b, mu_b = _factor(rng, u, unravel)
        dense = lambda g: (np.asarray(family.precision_matrix(g.precision)), _flat(g.precision_mean))  # noqa: E731
        lam, eta = dense(K.product(a, b))
        np.testing.assert_allclose(lam, lam_a + lam_b, rtol=1e-10, atol=1e-12)
        np.testing.assert_allclose(eta, lam_a @ mu_a + lam_b @ mu_b, rtol=1e-10, atol=1e-12)
        lam, eta = dense(K.quotient(K.product(a, b), b))
        np.testing.assert_allclose(lam, lam_a, rtol=1e-10, atol=1e-12)
        lam, _ = dense(K.difference(b, a))
        np.testing.assert_allclose(lam, lam_b - lam_a, rtol=1e-10, atol=1e-12)
        lam, _ = dense(K.power(a, 0.3))
        np.testing.assert_allclose(lam, 0.3 * lam_a, rtol=1e-10, atol=1e-12)
        lam, _ = dense(K.damp(a, b, 0.25))
        np.testing.assert_allclose(lam, 0.75 * lam_a + 0.25 * lam_b, rtol=1e-10, atol=1e-12)
        cov_a = np.linalg.inv(lam_a)
        diff = mu_a - mu_b
        want = 0.5 * (np.trace(lam_b @ cov_a) - len(u) + diff @ lam_b @ diff + np.linalg.slogdet(lam_a)[1] - np.linalg.slogdet(lam_b)[1])
        np.testing.assert_allclose(float(family.kl(a, b)), want, rtol=1e-8, atol=1e-10)
        lam, _ = dense(K.product(a, family.uniform_like(params)))
        np.testing.assert_allclose(lam, lam_a, rtol=1e-12, atol=1e-12)
        np.testing.assert_allclose(np.asarray(family.precision_matrix(family.scaled_identity(params, 1.7))), 1.7 * np.eye(len(u)), atol=1e-12)


@given(cases)
def test_projection_is_the_diagonal_in_the_new_bases(case):
    shapes, seed = case
    with jax.enable_x64(True):
        rng, params, old, u_old, unravel = _case(shapes, seed)
        new = _random_bases(rng, params)
        u_new = _dense_u(params, new)
        g, lam, _ = _factor(rng, u_old, unravel)
        moved = K.project(g.precision, old, new)
        np.testing.assert_allclose(_flat(moved), np.diag(u_new.T @ lam @ u_new), rtol=1e-10, atol=1e-12)
        # from the identity: a diagonal precision's diagonal in the bases, each a convex combination (>= its minimum)
        identity = K.identity_bases(params)
        d = rng.uniform(0.5, 2.0, size=len(u_old))
        from_diag = _flat(K.project(unravel(jnp.asarray(d)), identity, new))
        np.testing.assert_allclose(from_diag, np.diag(u_new.T @ np.diag(d) @ u_new), rtol=1e-10)
        assert from_diag.min() >= d.min() - 1e-12
        np.testing.assert_allclose(_flat(K.project(unravel(jnp.asarray(d)), None, new)), from_diag, rtol=1e-12)  # None: the identity
        # the same bases: nothing moves
        np.testing.assert_allclose(_flat(K.project(g.precision, old, old)), _flat(g.precision), rtol=1e-10)


def test_bases_from_factors_are_their_eigenvectors_and_a_zero_factor_keeps_the_identity():
    with jax.enable_x64(True):
        rng = np.random.default_rng(0)
        a = rng.normal(size=(3, 5))
        factors = {"dense": {"kernel": K.KronBasis(jnp.asarray(a @ a.T), jnp.zeros((2, 2))), "bias": K.KronBasis(None, jnp.zeros((2, 2)))}}
        bases = K.bases_from_factors(factors)
        left = np.asarray(bases["dense"]["kernel"].left)
        np.testing.assert_allclose(left.T @ left, np.eye(3), atol=1e-12)
        rotated = left.T @ (a @ a.T) @ left
        np.testing.assert_allclose(rotated - np.diag(np.diag(rotated)), 0.0, atol=1e-10)
        np.testing.assert_array_equal(np.asarray(bases["dense"]["kernel"].right), np.eye(2))
        assert bases["dense"]["bias"].left is None


def test_identity_bases_and_their_size():
    params = _params(STRUCTURES[1])
    bases = K.identity_bases(params)
    assert bases["conv"]["kernel"].left.shape == (4, 4) and bases["conv"]["kernel"].right.shape == (2, 2)
    assert bases["conv"]["bias"].left is None and bases["conv"]["bias"].right.shape == (2, 2)
    assert K.factor_numbers(params) == (16 + 4) + 4 + (16 + 9)
    shapes = jax.tree.map(lambda p: jax.ShapeDtypeStruct(p.shape, p.dtype), params)
    assert K.factor_numbers(shapes) == K.factor_numbers(params)
    other = K.identity_bases(_params(STRUCTURES[2]))
    assert other["scale"] == K.KronBasis(None, None)
