"""Tests for fedbayes.gaussian_lowrank against dense numpy/scipy linear algebra (float64).

Every operation on Lambda = diag(d) + U diag(s) U^T is checked against the same operation on the
dense matrix (:func:`fedbayes.gaussian_lowrank.precision_matrix`), including signed weights (the
cavities of EP) and ranks above the dimension.
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
from fedbayes import gaussian_lowrank as L

STRUCTURES = ({"w": (3,)}, {"w": (2, 2), "b": (2,)})


def _flat(tree):
    return np.asarray(ravel_pytree(jax.tree.map(jnp.asarray, tree))[0])


def _lowrank(rng, shapes, rank, negative=False):
    """A proper LowRankGaussian (diag in [0.5, 2], directions of scale 1) and its dense precision."""
    mean = {k: rng.normal(size=s) for k, s in shapes.items()}
    dim = _flat(mean).size
    diag = {k: rng.uniform(0.5, 2.0, size=s) for k, s in shapes.items()}
    u = rng.normal(size=(dim, rank))
    s = rng.uniform(0.2, 1.5, size=rank)
    if negative and rank:
        s[0] = -0.2 * rng.uniform(0.0, 1.0)  # still proper: small against the diagonal's floor
        u[:, 0] /= np.linalg.norm(u[:, 0])
    lam = np.diag(_flat(diag)) + (u * s) @ u.T
    eta = lam @ _flat(mean)
    _, unravel = ravel_pytree(jax.tree.map(jnp.asarray, mean))
    g = L.LowRankGaussian(unravel(jnp.asarray(eta)), jax.tree.map(jnp.asarray, diag), jnp.asarray(u), jnp.asarray(s))
    return g, lam, _flat(mean)


cases = st.tuples(st.sampled_from(STRUCTURES), st.integers(0, 5), st.booleans(), st.integers(0, 2**31 - 1))


@given(cases)
def test_moments_against_dense(case):
    shapes, rank, negative, seed = case
    with jax.enable_x64(True):
        g, lam, mu = _lowrank(np.random.default_rng(seed), shapes, rank, negative)
        np.testing.assert_allclose(np.asarray(L.precision_matrix(g)), lam, rtol=1e-12, atol=1e-12)
        cov = np.linalg.inv(lam)
        np.testing.assert_allclose(_flat(L.mean(g)), mu, rtol=1e-8, atol=1e-9)
        np.testing.assert_allclose(_flat(L.variance(g)), np.diag(cov), rtol=1e-8)
        assert bool(L.is_proper(g))
        jac = np.random.default_rng(seed + 1).normal(size=(2, mu.size))
        np.testing.assert_allclose(np.asarray(L.predictive_variance(g, jnp.asarray(jac))), jac @ cov @ jac.T, rtol=1e-8, atol=1e-10)


@given(cases, st.floats(0.0, 1.0))
def test_algebra_against_dense(case, delta):
    shapes, rank, negative, seed = case
    rng = np.random.default_rng(seed)
    with jax.enable_x64(True):
        a, la, _ = _lowrank(rng, shapes, rank, negative)
        b, lb, _ = _lowrank(rng, shapes, max(rank - 1, 0))
        ea, eb = _flat(a.precision_mean), _flat(b.precision_mean)
        for got, lam, eta in (
            (L.product(a, b), la + lb, ea + eb),
            (L.quotient(a, b), la - lb, ea - eb),
            (L.power(a, 0.3), 0.3 * la, 0.3 * ea),
            (L.damp(a, b, delta), (1 - delta) * la + delta * lb, (1 - delta) * ea + delta * eb),
        ):
            np.testing.assert_allclose(np.asarray(L.precision_matrix(got)), lam, rtol=1e-10, atol=1e-10)
            np.testing.assert_allclose(_flat(got.precision_mean), eta, rtol=1e-12, atol=1e-12)
        # the quotient's propriety is the dense matrix's
        q = L.quotient(a, b)
        assert bool(L.is_proper(q)) == bool(np.linalg.eigvalsh(la - lb).min() > 0 and (_flat(a.diag) > _flat(b.diag)).all())


@given(cases)
def test_truncate_exact_above_the_rank(case):
    shapes, rank, negative, seed = case
    rng = np.random.default_rng(seed)
    with jax.enable_x64(True):
        a, la, _ = _lowrank(rng, shapes, rank, negative)
        b, lb, _ = _lowrank(rng, shapes, rank)
        both = L.product(a, b)  # rank 2r, true rank <= min(2r, D)
        kept = L.truncate(both, 2 * rank)
        assert L.rank(kept) == 2 * rank
        np.testing.assert_allclose(np.asarray(L.precision_matrix(kept)), la + lb, rtol=1e-9, atol=1e-9)


def test_truncate_keeps_the_largest_directions():
    rng = np.random.default_rng(0)
    with jax.enable_x64(True):
        g, lam, _ = _lowrank(rng, STRUCTURES[1], 4)
        low = (np.asarray(g.factors) * np.asarray(g.weights)) @ np.asarray(g.factors).T
        values, vectors = np.linalg.eigh(low)
        top = np.argsort(-np.abs(values))[:2]
        want = np.diag(np.diag(lam - low)) + (vectors[:, top] * values[top]) @ vectors[:, top].T
        np.testing.assert_allclose(np.asarray(L.precision_matrix(L.truncate(g, 2))), want, rtol=1e-9, atol=1e-9)


@given(cases)
def test_kl_log_prob_entropy_against_dense(case):
    shapes, rank, negative, seed = case
    rng = np.random.default_rng(seed)
    with jax.enable_x64(True):
        p, lp, mp = _lowrank(rng, shapes, rank, negative)
        q, lq, mq = _lowrank(rng, shapes, max(rank - 2, 0))
        sp, sq = np.linalg.inv(lp), np.linalg.inv(lq)
        want = 0.5 * (np.trace(lq @ sp) - mp.size + (mp - mq) @ lq @ (mp - mq) + np.linalg.slogdet(sq)[1] - np.linalg.slogdet(sp)[1])
        np.testing.assert_allclose(float(L.kl(p, q)), want, rtol=1e-8, atol=1e-10)
        assert abs(float(L.kl(p, p))) < 1e-9
        x = rng.normal(size=mp.size)
        _, unravel = ravel_pytree(p.precision_mean)
        np.testing.assert_allclose(float(L.log_prob(p, unravel(jnp.asarray(x)))), scipy.stats.multivariate_normal(mp, sp).logpdf(x), rtol=1e-9)
        np.testing.assert_allclose(float(L.entropy(p)), scipy.stats.multivariate_normal(mp, sp).entropy(), rtol=1e-9)
        # the dense family gives the same KL on the same densities
        fp = F.from_moments(unravel(jnp.asarray(mp)), jnp.asarray(sp))
        fq = F.from_moments(unravel(jnp.asarray(mq)), jnp.asarray(sq))
        np.testing.assert_allclose(float(L.kl(p, q)), float(F.kl(fp, fq)), rtol=1e-7, atol=1e-9)


def test_diagonal_family_is_rank_zero():
    rng = np.random.default_rng(4)
    with jax.enable_x64(True):
        mean = {"w": jnp.asarray(rng.normal(size=(2, 2)))}
        var = {"w": jnp.asarray(rng.uniform(0.5, 2.0, size=(2, 2)))}
        d = G.from_moments(mean, var)
        other = G.from_moments({"w": mean["w"] + 1.0}, {"w": 2.0 * var["w"]})
        g = L.from_diag(d, rank=2)
        assert L.rank(g) == 2
        np.testing.assert_allclose(_flat(L.variance(g)), _flat(var), rtol=1e-12)
        np.testing.assert_allclose(float(L.kl(g, other)), float(G.kl(d, other)), rtol=1e-10)
        np.testing.assert_allclose(_flat(L.project_to_diag(g).precision), _flat(d.precision), rtol=1e-12)


def test_improper_flagged():
    rng = np.random.default_rng(5)
    with jax.enable_x64(True):
        g, _, _ = _lowrank(rng, STRUCTURES[0], 2)
        assert not bool(L.is_proper(L.uniform_like(g.precision_mean)))
        assert not bool(L.is_proper(L.quotient(g, L.product(g, g))))
        big_negative = L.LowRankGaussian(g.precision_mean, g.diag, g.factors[:, :1] * 10.0, -jnp.ones(1))
        assert not bool(L.is_proper(big_negative))


def test_samples_have_the_moments():
    rng = np.random.default_rng(6)
    with jax.enable_x64(True):
        g, lam, mu = _lowrank(rng, STRUCTURES[1], 3, negative=True)
        cov = np.linalg.inv(lam)
        draws = L.sample(jax.random.key(1), g, num_samples=40_000)
        flat = np.asarray(jax.vmap(lambda t: ravel_pytree(t)[0])(draws))
        np.testing.assert_allclose(flat.mean(0), mu, atol=4 * np.sqrt(np.diag(cov).max() / 40_000))
        np.testing.assert_allclose(np.cov(flat.T), cov, atol=0.05 * np.abs(cov).max())


def test_a_layers_marginal_is_drawn_as_the_joints_sub_vector():
    with jax.enable_x64(True):
        g, lam, mu = _lowrank(np.random.default_rng(4), {"w": (2, 2), "b": (2,)}, 3)
        m = L.marginal(g, "w")
        draws = L.sample_marginal(jax.random.key(0), m, 40_000)
        np.testing.assert_array_equal(np.asarray(draws["b"]), np.broadcast_to(np.asarray(L.mean(g)["b"]), (40_000, 2)))
        # the ravel order is b then w: the marginal covariance is the joint covariance's w block
        cov = np.linalg.inv(lam)[2:, 2:]
        w = np.asarray(draws["w"]).reshape(40_000, 4)
        np.testing.assert_allclose(w.mean(axis=0), mu[2:], atol=0.03)
        np.testing.assert_allclose(np.cov(w.T), cov, atol=0.03 * np.abs(cov).max())
        with pytest.raises(ValueError, match="no top-level entry 'output'"):
            L.marginal(g, "output")
