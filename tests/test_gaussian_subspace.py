"""Tests for fedbayes.gaussian_subspace against dense numpy linear algebra (float64).

Every operation on Lambda = diag(d) + B S B^T in a shared orthonormal basis B is checked against
the same operation on the dense matrix, over shapes, ranks and signed cores (EP's cavities).
"""

import jax
import jax.numpy as jnp
import numpy as np
import scipy.stats
from hypothesis import given
from hypothesis import strategies as st
from jax.flatten_util import ravel_pytree

from fedbayes import gaussian_subspace as S

STRUCTURES = ({"w": (4,)}, {"w": (2, 3), "b": (3,)})


def _flat(tree):
    return np.asarray(ravel_pytree(jax.tree.map(jnp.asarray, tree))[0])


def _unravel(shapes):
    return ravel_pytree({k: jnp.zeros(s) for k, s in shapes.items()})[1]


def _basis(rng, dim, rank):
    return np.linalg.qr(rng.normal(size=(dim, rank)))[0]


def _factor(rng, shapes, basis, signed=False):
    """A proper factor in ``basis`` (diagonal in [0.5, 2], a core of either sign when ``signed``,
    small enough to keep Lambda positive definite) and its dense precision and mean."""
    unravel = _unravel(shapes)
    dim, rank = basis.shape
    a = rng.normal(size=(rank, rank))
    core = a @ a.T if not signed else 0.4 * (a + a.T) / (1.0 + np.abs(np.linalg.eigvalsh(a + a.T)).max())
    d = rng.uniform(0.5, 2.0, size=dim)
    lam = np.diag(d) + basis @ core @ basis.T
    mu = rng.normal(size=dim)
    g = S.SubspaceGaussian(unravel(jnp.asarray(lam @ mu)), S.SubspacePrecision(unravel(jnp.asarray(d)), jnp.asarray(core)))
    return g, lam, mu


cases = st.tuples(st.sampled_from(STRUCTURES), st.integers(1, 4), st.booleans(), st.integers(0, 2**31 - 1))


def _case(shapes, rank, seed):
    """``(rng, dim, basis, family)`` of a hypothesis case."""
    rng = np.random.default_rng(seed)
    dim = _flat({k: np.zeros(s) for k, s in shapes.items()}).size
    basis = _basis(rng, dim, rank)
    return rng, dim, basis, S.in_basis(jnp.asarray(basis))


@given(cases)
def test_moments_draws_and_densities_against_dense(case):
    shapes, rank, signed, seed = case
    with jax.enable_x64(True):
        rng, dim, basis, family = _case(shapes, rank, seed)
        g, lam, mu = _factor(rng, shapes, basis, signed)
        np.testing.assert_allclose(np.asarray(family.precision_matrix(g.precision)), lam, rtol=1e-12, atol=1e-12)
        cov = np.linalg.inv(lam)
        np.testing.assert_allclose(_flat(family.mean(g)), mu, rtol=1e-8, atol=1e-9)
        np.testing.assert_allclose(_flat(family.variance(g)), np.diag(cov), rtol=1e-8)
        assert bool(family.is_proper(g))
        x = rng.normal(size=dim)
        np.testing.assert_allclose(_flat(family.matvec(g.precision, _unravel(shapes)(jnp.asarray(x)))), lam @ x, rtol=1e-10, atol=1e-12)
        np.testing.assert_allclose(_flat(family.solve(g.precision, _unravel(shapes)(jnp.asarray(x)))), cov @ x, rtol=1e-8, atol=1e-10)
        assert np.all(_flat(family.row_bound(g.precision, g.precision_mean)) >= np.abs(lam).sum(axis=1) - 1e-10)
        np.testing.assert_allclose(float(family.log_prob(g, _unravel(shapes)(jnp.asarray(x)))), scipy.stats.multivariate_normal(mu, cov).logpdf(x), rtol=1e-8)
        diag = family.project_to_diag(g)
        np.testing.assert_allclose(_flat(diag.precision), 1.0 / np.diag(cov), rtol=1e-8)
        draws = np.asarray(jax.vmap(lambda t: ravel_pytree(t)[0])(family.sample(jax.random.key(seed % 1000), g, 20_000)))
        np.testing.assert_allclose(draws.mean(axis=0), mu, atol=6 * np.sqrt(np.diag(cov).max() / 20_000))
        np.testing.assert_allclose(np.cov(draws.T), cov, atol=0.08 * np.abs(cov).max())


@given(cases)
def test_products_quotients_damping_and_kl_against_dense(case):
    shapes, rank, signed, seed = case
    with jax.enable_x64(True):
        rng, dim, basis, family = _case(shapes, rank, seed)
        a, lam_a, mu_a = _factor(rng, shapes, basis)
        b, lam_b, mu_b = _factor(rng, shapes, basis, signed)
        dense = lambda g: (np.asarray(family.precision_matrix(g.precision)), _flat(g.precision_mean))  # noqa: E731
        lam, eta = dense(S.product(a, b))
        np.testing.assert_allclose(lam, lam_a + lam_b, rtol=1e-12, atol=1e-12)
        np.testing.assert_allclose(eta, lam_a @ mu_a + lam_b @ mu_b, rtol=1e-10, atol=1e-12)
        lam, eta = dense(S.quotient(S.product(a, b), b))
        np.testing.assert_allclose(lam, lam_a, rtol=1e-10, atol=1e-12)
        np.testing.assert_allclose(eta, lam_a @ mu_a, rtol=1e-10, atol=1e-12)
        lam, _ = dense(S.difference(b, a))
        np.testing.assert_allclose(lam, lam_b - lam_a, rtol=1e-10, atol=1e-12)
        lam, _ = dense(S.power(a, 0.3))
        np.testing.assert_allclose(lam, 0.3 * lam_a, rtol=1e-12, atol=1e-12)
        lam, eta = dense(S.damp(a, b, 0.25))
        np.testing.assert_allclose(lam, 0.75 * lam_a + 0.25 * lam_b, rtol=1e-10, atol=1e-12)
        # KL(a || b) = 1/2 [tr(L_b S_a) - D + (m_a - m_b)^T L_b (m_a - m_b) + log|L_a| - log|L_b|]
        cov_a = np.linalg.inv(lam_a)
        diff = mu_a - mu_b
        want = 0.5 * (np.trace(lam_b @ cov_a) - dim + diff @ lam_b @ diff + np.linalg.slogdet(lam_a)[1] - np.linalg.slogdet(lam_b)[1])
        np.testing.assert_allclose(float(family.kl(a, b)), want, rtol=1e-8, atol=1e-10)
        # the identity of the product
        lam, _ = dense(S.product(a, family.uniform_like(a.precision_mean)))
        np.testing.assert_allclose(lam, lam_a, rtol=1e-12, atol=1e-12)


@given(st.tuples(st.integers(2, 9), st.integers(1, 4), st.integers(0, 2**31 - 1)))
def test_a_curvature_in_the_structure_is_exact_in_the_span_and_diagonal_outside(case):
    dim, rank, seed = case
    rank = min(rank, dim - 1)
    with jax.enable_x64(True):
        rng = np.random.default_rng(seed)
        a = rng.normal(size=(dim, dim + 2))
        g = a @ a.T  # PSD
        basis = _basis(rng, dim, rank)
        structured = S.from_curvature(jnp.asarray(np.diag(g)), jnp.asarray(g @ basis), jnp.asarray(basis))
        p = basis @ basis.T
        rest = (np.eye(dim) - p) @ g @ (np.eye(dim) - p)
        np.testing.assert_allclose(np.asarray(structured.core), basis.T @ g @ basis, rtol=1e-10, atol=1e-12)
        np.testing.assert_allclose(np.asarray(structured.diagonal), np.diag(rest), rtol=1e-8, atol=1e-10)
        assert np.all(np.asarray(structured.diagonal) >= 0)
        # a basis that spans an eigenspace keeps the curvature there exactly: B^T (Lambda) B = B^T G B
        evals, evecs = np.linalg.eigh(g)
        top = evecs[:, -rank:]
        exact = S.from_curvature(jnp.asarray(np.diag(g)), jnp.asarray(g @ top), jnp.asarray(top))
        np.testing.assert_allclose(np.asarray(exact.core), np.diag(evals[-rank:]), atol=1e-8 * evals.max())


def test_projection_to_a_new_basis_keeps_what_lies_in_its_span():
    with jax.enable_x64(True):
        rng = np.random.default_rng(0)
        shapes = {"w": (6,)}
        old = _basis(rng, 6, 3)
        g, lam, _ = _factor(rng, shapes, old)
        rotation = np.linalg.qr(rng.normal(size=(3, 3)))[0]
        same_span = old @ rotation
        moved = S.project(g, jnp.asarray(old), jnp.asarray(same_span))
        np.testing.assert_allclose(np.asarray(S.in_basis(jnp.asarray(same_span)).precision_matrix(moved.precision)), lam, rtol=1e-10, atol=1e-12)
        # a basis orthogonal to the old one keeps the diagonal only
        other = np.linalg.qr(np.concatenate([old, rng.normal(size=(6, 3))], axis=1))[0][:, 3:]
        dropped = S.project(g, jnp.asarray(old), jnp.asarray(other))
        np.testing.assert_allclose(np.asarray(dropped.precision.core), 0.0, atol=1e-12)


def test_orthonormal_basis_spans_the_sketch():
    rng = np.random.default_rng(3)
    sketch = rng.normal(size=(8, 3))
    basis = np.asarray(S.orthonormal_basis(jnp.asarray(sketch)))
    np.testing.assert_allclose(basis.T @ basis, np.eye(3), atol=1e-5)
    np.testing.assert_allclose(basis @ basis.T @ sketch, sketch, atol=1e-5)


def test_a_basis_beyond_the_curvatures_rank_gives_a_psd_core_in_float32():
    """Directions of the basis in ``G``'s null space: ``B^T G B`` is PSD, and its float32 round-off
    below zero must not make a client's curvature look invalid (a negative diagonal entry did: 93% of
    the messages of a rank-40 run on a GGN of rank 31 were rejected)."""
    rng = np.random.default_rng(0)
    a = rng.normal(size=(40, 12)) * 30.0
    g = (a @ a.T).astype(np.float32)  # rank 12 of 40
    null = np.linalg.svd(a)[0][:, 12:]  # [40, 28]: G's null space
    for trial in range(20):
        basis = np.linalg.qr(null @ rng.normal(size=(28, 10)))[0].astype(np.float32)
        structured = S.from_curvature(jnp.asarray(np.diag(g)), jnp.asarray(g @ basis), jnp.asarray(basis))
        assert np.all(np.diagonal(np.asarray(structured.core)) >= 0), trial
        assert np.all(np.asarray(structured.diagonal) >= 0), trial
