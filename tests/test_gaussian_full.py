"""Tests for fedbayes.gaussian_full against dense numpy/scipy linear algebra (float64).

Inputs are random symmetric positive definite matrices over small pytrees (hypothesis chooses the
structure and the seed); every operation is checked against the same formula written with
``numpy.linalg`` and ``scipy.stats``.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import scipy.stats
from hypothesis import given
from hypothesis import strategies as st
from jax.flatten_util import ravel_pytree

from fedbayes import gaussian as G
from fedbayes import gaussian_full as F

# A small alphabet of structures: each new shape costs XLA compiles.
STRUCTURES = ({"w": (2,)}, {"w": (2, 2), "b": (2,)}, {"w": (3,), "b": (), "c": (2, 1)})


def _spd(rng, d, floor=0.5):
    a = rng.normal(size=(d, d))
    return a @ a.T + floor * np.eye(d)


def _tree(rng, shapes):
    return {k: rng.normal(size=s) for k, s in shapes.items()}


def _flat(tree):
    return np.asarray(ravel_pytree(jax.tree.map(jnp.asarray, tree))[0])


def _gaussian(rng, shapes):
    """A FullGaussian with its numpy moments (mean flat, covariance)."""
    mu = _tree(rng, shapes)
    d = _flat(mu).size
    cov = np.linalg.inv(_spd(rng, d))
    return F.from_moments(jax.tree.map(jnp.asarray, mu), jnp.asarray(cov)), _flat(mu), cov


def _dense_kl(m1, s1, m2, s2):
    l2 = np.linalg.inv(s2)
    d = m1.size
    return 0.5 * (np.trace(l2 @ s1) - d + (m1 - m2) @ l2 @ (m1 - m2) + np.linalg.slogdet(s2)[1] - np.linalg.slogdet(s1)[1])


cases = st.tuples(st.sampled_from(STRUCTURES), st.integers(0, 2**31 - 1))


@given(cases)
def test_moments_round_trip(case):
    shapes, seed = case
    with jax.enable_x64(True):
        g, mu, cov = _gaussian(np.random.default_rng(seed), shapes)
        np.testing.assert_allclose(_flat(F.mean(g)), mu, rtol=1e-9, atol=1e-9)
        np.testing.assert_allclose(np.asarray(F.covariance(g)), cov, rtol=1e-9, atol=1e-10)
        np.testing.assert_allclose(_flat(F.variance(g)), np.diag(cov), rtol=1e-9)
        np.testing.assert_allclose(np.asarray(g.precision), np.linalg.inv(cov), rtol=1e-8, atol=1e-9)
        assert bool(F.is_proper(g))


@given(cases, st.floats(0.0, 1.0))
def test_natural_parameter_algebra(case, delta):
    shapes, seed = case
    rng = np.random.default_rng(seed)
    with jax.enable_x64(True):
        a, _, _ = _gaussian(rng, shapes)
        b, _, _ = _gaussian(rng, shapes)
        la, lb = np.asarray(a.precision), np.asarray(b.precision)
        ea, eb = _flat(a.precision_mean), _flat(b.precision_mean)
        for got, lam, eta in (
            (F.product(a, b), la + lb, ea + eb),
            (F.quotient(a, b), la - lb, ea - eb),
            (F.power(a, 0.3), 0.3 * la, 0.3 * ea),
            (F.damp(a, b, delta), (1 - delta) * la + delta * lb, (1 - delta) * ea + delta * eb),
        ):
            np.testing.assert_allclose(np.asarray(got.precision), lam, rtol=1e-12, atol=1e-12)
            np.testing.assert_allclose(_flat(got.precision_mean), eta, rtol=1e-12, atol=1e-12)
        back = F.quotient(F.product(a, b), b)
        np.testing.assert_allclose(_flat(F.mean(back)), _flat(F.mean(a)), rtol=1e-8, atol=1e-8)
        unit = F.product(a, F.uniform_like(a.precision_mean))
        np.testing.assert_array_equal(np.asarray(unit.precision), la)


@given(cases)
def test_kl_log_prob_entropy_against_scipy(case):
    shapes, seed = case
    rng = np.random.default_rng(seed)
    with jax.enable_x64(True):
        p, mp, sp = _gaussian(rng, shapes)
        q, mq, sq = _gaussian(rng, shapes)
        np.testing.assert_allclose(float(F.kl(p, q)), _dense_kl(mp, sp, mq, sq), rtol=1e-8, atol=1e-10)
        assert abs(float(F.kl(p, p))) < 1e-9
        x = _tree(rng, shapes)
        want = scipy.stats.multivariate_normal(mp, sp).logpdf(_flat(x))
        np.testing.assert_allclose(float(F.log_prob(p, jax.tree.map(jnp.asarray, x))), want, rtol=1e-9)
        np.testing.assert_allclose(float(F.entropy(p)), scipy.stats.multivariate_normal(mp, sp).entropy(), rtol=1e-9)
        jac = rng.normal(size=(3, mp.size))
        np.testing.assert_allclose(np.asarray(F.predictive_variance(p, jnp.asarray(jac))), jac @ sp @ jac.T, rtol=1e-8, atol=1e-10)


@given(cases)
def test_diagonal_family_is_a_special_case(case):
    """A diagonal Gaussian promoted to the dense family gives the diagonal family's numbers."""
    shapes, seed = case
    rng = np.random.default_rng(seed)
    with jax.enable_x64(True):
        mean = jax.tree.map(jnp.asarray, _tree(rng, shapes))
        var = jax.tree.map(lambda x: jnp.asarray(rng.uniform(0.2, 3.0, size=np.shape(x))), mean)
        d = G.from_moments(mean, var)
        other = G.from_moments(jax.tree.map(lambda x: x + 0.5, mean), jax.tree.map(lambda v: 2 * v, var))
        full = F.to_full(d)
        np.testing.assert_allclose(_flat(F.variance(full)), _flat(var), rtol=1e-12)
        np.testing.assert_allclose(float(F.kl(full, other)), float(G.kl(d, other)), rtol=1e-9)
        np.testing.assert_allclose(float(F.entropy(full)), float(G.entropy(d)), rtol=1e-12)
        proj = F.project_to_diag(full)
        np.testing.assert_allclose(_flat(proj.precision), _flat(d.precision), rtol=1e-12)


def test_projection_keeps_marginal_variances():
    rng = np.random.default_rng(3)
    with jax.enable_x64(True):
        g, mu, cov = _gaussian(rng, STRUCTURES[1])
        got = F.project_to_diag(g)
        want = G.project_full_to_diag(jnp.asarray(mu), jnp.asarray(cov))
        np.testing.assert_allclose(_flat(got.precision), np.asarray(want.precision), rtol=1e-9)
        np.testing.assert_allclose(_flat(G.mean(got)), mu, rtol=1e-9, atol=1e-12)


def test_improper_quotient_is_flagged():
    rng = np.random.default_rng(0)
    with jax.enable_x64(True):
        a, _, _ = _gaussian(rng, STRUCTURES[1])
        bigger = F.product(a, a)
        assert bool(F.is_proper(a))
        assert not bool(F.is_proper(F.quotient(a, bigger)))  # precision -Lambda_a
        assert not bool(F.is_proper(F.uniform_like(a.precision_mean)))


def test_samples_have_the_moments():
    rng = np.random.default_rng(1)
    with jax.enable_x64(True):
        g, mu, cov = _gaussian(rng, STRUCTURES[1])
        draws = F.sample(jax.random.key(0), g, num_samples=40_000)
        flat = np.asarray(jax.vmap(lambda t: ravel_pytree(t)[0])(draws))
        np.testing.assert_allclose(flat.mean(0), mu, atol=4 * np.sqrt(np.diag(cov).max() / 40_000))
        np.testing.assert_allclose(np.cov(flat.T), cov, atol=0.05 * np.abs(cov).max())
        one = F.sample(jax.random.key(0), g)
        assert jax.tree.structure(one) == jax.tree.structure(g.precision_mean)


def test_jit_and_shapes_checked():
    rng = np.random.default_rng(2)
    g, _, _ = _gaussian(rng, STRUCTURES[0])
    got = jax.jit(F.product)(g, g)
    np.testing.assert_allclose(np.asarray(got.precision), 2 * np.asarray(g.precision), rtol=1e-6)
    with pytest.raises(ValueError, match="must be"):
        F.mean(F.FullGaussian(g.precision_mean, jnp.eye(5)))
    with pytest.raises(TypeError, match="FullGaussian"):
        F.to_full("not a gaussian")


@given(st.integers(1, 5), st.integers(0, 2**31 - 1))
def test_cholesky_solves_against_numpy_and_under_vmap(d, seed):
    rng = np.random.default_rng(seed)
    with jax.enable_x64(True):
        mats = np.stack([_spd(rng, d) for _ in range(3)])
        b = rng.normal(size=(3, d))
        chol = jax.vmap(F.cholesky)(jnp.asarray(mats))
        solved = jax.vmap(F.cholesky_solve)(chol, jnp.asarray(b))
        drawn = jax.vmap(F.lower_transpose_solve)(chol, jnp.asarray(b))
        for k in range(3):
            lower = np.linalg.cholesky(mats[k])
            np.testing.assert_allclose(np.asarray(solved[k]), np.linalg.solve(mats[k], b[k]), rtol=1e-8, atol=1e-10)
            np.testing.assert_allclose(np.asarray(drawn[k]), np.linalg.solve(lower.T, b[k]), rtol=1e-8, atol=1e-10)
            np.testing.assert_allclose(np.asarray(F.cholesky_solve(chol[k], jnp.asarray(b[k]))), np.asarray(solved[k]), rtol=1e-12)
