"""Tests for fedbayes.gaussian: algebra (float64), oracles, Iso/Diag agreement, jit and vmap.

Algebra runs under ``jax.enable_x64(True)`` at tolerances derived from float64 rounding
(docs/style.md, Tests 1); oracles are scipy.stats, numpy closed forms and Monte Carlo with fixed keys
(Tests 2). Inputs and expectations are built with numpy: every eager JAX op on a new shape costs
an XLA compile, and those compiles, not the arithmetic, set the run time of this file.
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import scipy.stats
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from fedbayes import gaussian as G
from fedbayes import tree as ftree

EPS64 = np.finfo(np.float64).eps

SHAPES = {"w": (3, 2), "b": (2,), "s": ()}


# ---------------------------------------------------------------------------------------------
# helpers (numpy in, jax arrays out)


def _as_jax(tree, dtype=np.float64):
    return jax.tree.map(lambda x: jnp.asarray(np.asarray(x, dtype=dtype)), tree)


def _np(tree):
    return jax.tree.map(lambda x: np.asarray(x, dtype=np.float64), tree)


def random_moments(seed, shapes=SHAPES, log10_range=(-1.0, 1.0)):
    """Numpy means ~ N(0, 3^2) and log-uniform precisions, as two dicts."""
    rng = np.random.default_rng(seed)
    mu = {k: 3.0 * rng.normal(size=s) for k, s in shapes.items()}
    lam = {k: 10.0 ** rng.uniform(*log10_range, size=s) for k, s in shapes.items()}
    return mu, lam


def random_diag(seed, shapes=SHAPES, dtype=np.float64, log10_range=(-1.0, 1.0)):
    """A proper DiagGaussian with means ~ N(0, 3^2) and log-uniform precisions."""
    mu, lam = random_moments(seed, shapes, log10_range)
    eta = jax.tree.map(np.multiply, lam, mu)
    return G.DiagGaussian(precision_mean=_as_jax(eta, dtype), precision=_as_jax(lam, dtype))


def random_iso(seed, shapes=SHAPES, dtype=np.float64):
    """A proper IsoGaussian with means ~ N(0, 3^2) and a precision in [0.1, 10]."""
    mu, _ = random_moments(seed, shapes)
    lam = 10.0 ** np.random.default_rng(seed + 1000).uniform(-1.0, 1.0)
    eta = jax.tree.map(lambda m: lam * m, mu)
    return G.IsoGaussian(precision_mean=_as_jax(eta, dtype), precision=jnp.asarray(np.asarray(lam, dtype)))


def iso_as_diag_by_hand(g):
    """The DiagGaussian with the IsoGaussian's precision filled in, built without G.to_diag."""
    lam = np.asarray(g.precision)
    precision = jax.tree.map(lambda e: jnp.asarray(np.full(e.shape, lam, e.dtype)), g.precision_mean)
    return G.DiagGaussian(precision_mean=g.precision_mean, precision=precision)


def abs_sum(*gaussians):
    """Elementwise |x| + |y| + ... over the natural parameters (numpy), for rounding bounds."""
    return jax.tree.map(lambda *xs: sum(np.abs(np.asarray(x)) for x in xs), *gaussians)


def assert_tree_equal(got, want):
    assert jax.tree.structure(got) == jax.tree.structure(want)
    jax.tree.map(np.testing.assert_array_equal, got, want)


def assert_tree_close(got, want, rtol, atol=0.0):
    assert jax.tree.structure(got) == jax.tree.structure(want)
    jax.tree.map(
        lambda g, w: np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=rtol, atol=atol),
        got,
        want,
    )


def assert_gaussian_close(got, want, rtol, atol=0.0):
    assert type(got) is type(want)
    assert_tree_close(got, want, rtol=rtol, atol=atol)


def assert_within_rounding(got, want, scale, ulps):
    """|got - want| <= ulps * eps * scale elementwise (scale: the operands' magnitude)."""
    assert jax.tree.structure(got) == jax.tree.structure(want)
    leaves = zip(jax.tree.leaves(got), jax.tree.leaves(want), jax.tree.leaves(scale), strict=True)
    for g, w, s in leaves:
        err = np.abs(np.asarray(g) - np.asarray(w))
        bound = ulps * EPS64 * np.asarray(s)
        assert np.all(err <= bound), f"max err/bound {np.max(err / np.maximum(bound, 1e-300))}"


# ---------------------------------------------------------------------------------------------
# algebra identities (docs/algorithms.md §1.1 unit tests), float64


def _pair(kinds, seed):
    a = random_diag(seed) if kinds != "iso" else random_iso(seed)
    b = random_iso(seed + 1) if kinds != "diag" else random_diag(seed + 1)
    return a, b


@pytest.mark.parametrize("kinds", ["diag", "iso", "mixed"])
def test_product_quotient_round_trip(kinds):
    with jax.enable_x64(True):
        a, b = _pair(kinds, 0)
        got = G.quotient(G.product(a, b), b)
        want = G.to_diag(a) if kinds == "mixed" else a
        assert type(got) is type(want)
        # (x + y) - y: two roundings, each at most eps/2 of a value bounded by |x| + |y|.
        scale = abs_sum(a, b) if kinds == "iso" else abs_sum(G.to_diag(a), G.to_diag(b))
        assert_within_rounding(got, want, scale, ulps=2)


def test_product_quotient_golden():
    with jax.enable_x64(True):
        a = G.DiagGaussian({"x": jnp.asarray([1.0, -2.0])}, {"x": jnp.asarray([2.0, 0.5])})
        b = G.DiagGaussian({"x": jnp.asarray([3.0, 4.0])}, {"x": jnp.asarray([1.0, 1.5])})
        prod = G.product(a, b)
        np.testing.assert_array_equal(prod.precision_mean["x"], [4.0, 2.0])
        np.testing.assert_array_equal(prod.precision["x"], [3.0, 2.0])
        quot = G.quotient(a, b)
        np.testing.assert_array_equal(quot.precision_mean["x"], [-2.0, -6.0])
        np.testing.assert_array_equal(quot.precision["x"], [1.0, -1.0])
        assert_tree_equal(G.difference(a, b), quot)


@pytest.mark.parametrize("kind", ["diag", "iso"])
def test_power_identities(kind):
    with jax.enable_x64(True):
        q = random_diag(2) if kind == "diag" else random_iso(2)
        assert_tree_equal(G.power(q, 1.0), q)
        for a in (0.3, 0.5, 0.9, -0.7, 2.5):
            got = G.product(G.power(q, a), G.power(q, 1.0 - a))
            assert type(got) is type(q)
            # a x + (1 - a) x: four roundings, each of a term bounded by (|a| + |1 - a|) |x|.
            scale = jax.tree.map(lambda s, a=a: (abs(a) + abs(1.0 - a)) * s, abs_sum(q))
            assert_within_rounding(got, q, scale, ulps=4)
        zero = G.power(q, 0.0)
        assert not bool(G.is_proper(zero))
        jax.tree.map(lambda x: np.testing.assert_array_equal(x, 0.0), zero)
        # A negative power is an improper factor, returned as is.
        assert not bool(G.is_proper(G.power(q, -1.0)))


@pytest.mark.parametrize("kinds", ["diag", "iso", "mixed"])
def test_damp_endpoints_are_exact(kinds):
    with jax.enable_x64(True):
        old, new = _pair(kinds, 3)
        as_result = G.to_diag if kinds == "mixed" else (lambda g: g)
        assert_tree_equal(G.damp(old, new, 1.0), as_result(new))
        assert_tree_equal(G.damp(old, new, 0.0), as_result(old))
        half = G.damp(old, new, 0.5)
        mid = jax.tree.map(lambda x, y: 0.5 * (np.asarray(x) + np.asarray(y)), as_result(old), as_result(new))
        assert_tree_close(half, mid, rtol=4 * EPS64)  # two roundings of a convex combination
        assert type(half) is type(as_result(old))
        assert bool(G.is_proper(half))


def test_damp_matches_seed_incremental_form():
    # Guo et al. 2023 (FedEP) Sec. 2.2.3: eta_k <- eta_k + delta * Delta eta_k with Delta q = new / old.
    with jax.enable_x64(True):
        old, new = random_diag(5), random_diag(6)
        for step in (0.1, 0.75):
            incremental = G.product(old, G.power(G.difference(new, old), step))
            # The two forms round differently: (1-d) x + d y versus x + d (y - x).
            assert_gaussian_close(G.damp(old, new, step), incremental, rtol=1e-13, atol=1e-13)


@pytest.mark.parametrize("kind", ["diag", "iso"])
def test_moments_round_trip(kind):
    with jax.enable_x64(True):
        g = random_diag(7) if kind == "diag" else random_iso(7)
        mu, var = G.to_moments(g)
        if kind == "iso":
            assert np.ndim(var) == 0
        back = G.from_moments(mu, var)
        assert type(back) is type(g)
        assert_gaussian_close(back, g, rtol=4 * EPS64)  # a reciprocal and a product each way
        mu2, var2 = G.to_moments(back)
        assert_tree_close(mu2, mu, rtol=4 * EPS64)  # same: a few roundings
        assert_tree_close(var2, var, rtol=4 * EPS64)  # same: a few roundings
        assert_tree_equal(G.mean(g), mu)
        assert_tree_equal(G.variance(g), var)
        # Against numpy: mu = eta / Lambda, sigma^2 = 1 / Lambda.
        d = G.to_diag(g)
        assert_tree_equal(mu, jax.tree.map(np.divide, _np(d.precision_mean), _np(d.precision)))


def test_from_moments_golden():
    with jax.enable_x64(True):
        g = G.from_moments({"a": jnp.asarray([2.0, -1.0])}, {"a": jnp.asarray([4.0, 0.5])})
        assert isinstance(g, G.DiagGaussian)
        np.testing.assert_array_equal(g.precision["a"], [0.25, 2.0])
        np.testing.assert_array_equal(g.precision_mean["a"], [0.5, -2.0])
        iso = G.from_moments({"a": jnp.asarray([2.0, -1.0])}, 4.0)
        assert isinstance(iso, G.IsoGaussian)
        assert iso.precision.shape == ()
        np.testing.assert_array_equal(iso.precision, 0.25)
        np.testing.assert_array_equal(iso.precision_mean["a"], [0.5, -0.25])


@pytest.mark.parametrize("kind", ["diag", "iso"])
def test_kl_self_is_zero(kind):
    with jax.enable_x64(True):
        g = random_diag(8, log10_range=(-3.0, 3.0)) if kind == "diag" else random_iso(8)
        assert float(G.kl(g, g)) == 0.0
        assert float(G.kl(g, random_diag(9))) > 0.0


def test_diag_product_equals_dense_product():
    with jax.enable_x64(True):
        rng = np.random.default_rng(10)
        m1, m2 = rng.normal(size=5), rng.normal(size=5)
        v1, v2 = rng.uniform(0.1, 5.0, size=5), rng.uniform(0.1, 5.0, size=5)
        p1, p2 = np.linalg.inv(np.diag(v1)), np.linalg.inv(np.diag(v2))
        cov = np.linalg.inv(p1 + p2)
        mean = cov @ (p1 @ m1 + p2 @ m2)
        g = G.product(G.from_moments(*_as_jax((m1, v1))), G.from_moments(*_as_jax((m2, v2))))
        mu, var = G.to_moments(g)
        np.testing.assert_allclose(mu, mean, rtol=1e-12)  # LU inverses of the dense path
        np.testing.assert_allclose(var, np.diag(cov), rtol=1e-12)  # LU inverses of the dense path
        np.testing.assert_array_equal(cov - np.diag(np.diag(cov)), 0.0)


def test_project_full_to_diag_keeps_covariance_diagonal():
    with jax.enable_x64(True):
        rng = np.random.default_rng(11)
        a = rng.normal(size=(5, 5))
        cov = a @ a.T + 0.5 * np.eye(5)
        mean = rng.normal(size=5)
        g = G.project_full_to_diag(*_as_jax((mean, cov)))
        mu, var = G.to_moments(g)
        np.testing.assert_allclose(mu, mean, rtol=4 * EPS64)  # two roundings
        np.testing.assert_allclose(var, np.diag(cov), rtol=4 * EPS64)  # two roundings
        # Keeping the precision's diagonal instead would give a visibly different variance.
        assert np.max(np.abs(1.0 / np.diag(np.linalg.inv(cov)) - np.diag(cov))) > 0.1
        with pytest.raises(ValueError):
            G.project_full_to_diag(*_as_jax((np.zeros(3), np.eye(4))))


def test_product_of_projections_golden_toy():
    # docs/algorithms.md §15.1 / 7.11 item 2: "FedPA" on the 2-D toy = product of the diagonal projections.
    with jax.enable_x64(True):
        p1 = G.project_full_to_diag(*_as_jax(([7.0, -10.6], [[11.0, -5.3], [-5.3, 3.5]])))
        p2 = G.project_full_to_diag(*_as_jax(([0.2, 2.24], [[5.0, 4.9], [4.9, 5.5]])))
        g = G.product(G.product(G.uniform_like(jnp.asarray(np.zeros(2))), p1), p2)
        np.testing.assert_allclose(G.mean(g), [2.3250, -5.6067], atol=5e-5)  # spec gives 4 decimals


def test_quotient_validity_flags():
    with jax.enable_x64(True):
        a = G.DiagGaussian(*_as_jax(({"x": [1.0, 1.0, 1.0]}, {"x": [3.0, 2.0, 1.0]})))
        b = G.DiagGaussian(*_as_jax(({"x": [0.5, 0.5, 0.5]}, {"x": [1.0, 2.0, 2.0]})))
        np.testing.assert_array_equal(G.proper_mask(G.quotient(a, b))["x"], [True, False, False])
        assert not bool(G.is_proper(G.quotient(a, b)))
        assert bool(G.is_proper(G.quotient(G.product(a, b), b)))
        assert bool(G.is_proper(a))
        assert not bool(G.is_proper(G.uniform_like(a.precision)))
        nan_mean = G.DiagGaussian(_as_jax({"x": [1.0, np.nan, 1.0]}), a.precision)
        np.testing.assert_array_equal(G.proper_mask(nan_mean)["x"], [True, False, True])
        inf_prec = G.DiagGaussian(a.precision_mean, _as_jax({"x": [1.0, 1.0, np.inf]}))
        assert not bool(G.is_proper(inf_prec))
        # Isotropic: the shared precision decides every coordinate at once.
        ia = G.IsoGaussian(a.precision_mean, jnp.asarray(np.float64(1.0)))
        ib = G.IsoGaussian(a.precision_mean, jnp.asarray(np.float64(1.5)))
        assert bool(G.is_proper(G.quotient(ib, ia)))
        assert not bool(G.is_proper(G.quotient(ia, ib)))
        np.testing.assert_array_equal(G.proper_mask(G.quotient(ia, ib))["x"], [False] * 3)


def test_uniform_like_is_product_identity():
    with jax.enable_x64(True):
        g = random_diag(12)
        u = G.uniform_like(G.mean(g))
        assert isinstance(u, G.DiagGaussian)
        assert_tree_equal(G.product(u, g), g)
        assert_tree_equal(G.quotient(g, u), g)


def test_argument_errors():
    with jax.enable_x64(True):
        g = random_diag(13)
        with pytest.raises(TypeError):
            G.product(g, {"w": 1.0})
        with pytest.raises(ValueError, match="scalar"):
            G.power(g, np.ones(2))
        with pytest.raises(ValueError, match="scalar"):
            G.damp(g, g, np.ones(2))


# ---------------------------------------------------------------------------------------------
# oracles: scipy.stats, numpy closed forms, Monte Carlo with fixed keys


def test_log_prob_matches_scipy():
    with jax.enable_x64(True):
        mu, lam = random_moments(20)
        x, _ = random_moments(21)
        g = G.from_moments(_as_jax(mu), _as_jax(jax.tree.map(np.reciprocal, lam)))
        want = sum(scipy.stats.norm.logpdf(x[k], mu[k], 1.0 / np.sqrt(lam[k])).sum() for k in SHAPES)
        np.testing.assert_allclose(G.log_prob(g, _as_jax(x)), want, rtol=1e-12)  # summation order


def test_entropy_matches_scipy():
    with jax.enable_x64(True):
        mu, lam = random_moments(22)
        g = G.from_moments(_as_jax(mu), _as_jax(jax.tree.map(np.reciprocal, lam)))
        want = sum(scipy.stats.norm(scale=1.0 / np.sqrt(lam[k])).entropy().sum() for k in SHAPES)
        np.testing.assert_allclose(G.entropy(g), want, rtol=1e-12)  # summation order


def _kl_numpy(p_moments, q_moments):
    """docs/algorithms.md §1.1 formula on numpy moments, independent of the library's ratio form."""
    (m1, lam1), (m2, lam2) = p_moments, q_moments
    total = 0.0
    for k in m1:
        s1, s2 = 1.0 / lam1[k], 1.0 / lam2[k]
        total += 0.5 * np.sum(np.log(s2 / s1) + (s1 + (m1[k] - m2[k]) ** 2) / s2 - 1.0)
    return total


def _diag_from_numpy(moments):
    mu, lam = moments
    return G.DiagGaussian(_as_jax(jax.tree.map(np.multiply, lam, mu)), _as_jax(lam))


def test_kl_matches_closed_form_and_golden():
    with jax.enable_x64(True):
        pm, qm = random_moments(23), random_moments(24)
        kl = G.kl(_diag_from_numpy(pm), _diag_from_numpy(qm))
        np.testing.assert_allclose(kl, _kl_numpy(pm, qm), rtol=1e-12)  # summation order
        # KL(N(0, 1) || N(1, 4)) = 0.5 (log 4 + 2/4 - 1) per coordinate, three coordinates.
        one = _diag_from_numpy(({"x": np.zeros(3)}, {"x": np.ones(3)}))
        other = _diag_from_numpy(({"x": np.ones(3)}, {"x": np.full(3, 0.25)}))
        np.testing.assert_allclose(G.kl(one, other), 1.5 * (math.log(4.0) - 0.5), rtol=1e-14)  # few ops


# One compiled sampler shared by the Monte Carlo tests (a threefry program takes about a second
# to compile); IsoGaussian draws are checked to equal DiagGaussian draws in test_iso_matches_diag.
_sample_jit = jax.jit(G.sample, static_argnums=2)
NUM_MC = 20000


def test_kl_matches_monte_carlo():
    with jax.enable_x64(True):
        p, q = random_diag(25), random_diag(26)
        x = _sample_jit(jax.random.key(1), p, NUM_MC)
        log_ratio = np.asarray(jax.jit(jax.vmap(lambda xi: G.log_prob(p, xi) - G.log_prob(q, xi)))(x))
        estimate, stderr = log_ratio.mean(), log_ratio.std() / math.sqrt(NUM_MC)
        exact = float(G.kl(p, q))
        # 5 standard errors of the Monte Carlo mean (the key is fixed, so this is deterministic).
        assert abs(estimate - exact) < 5 * stderr
        assert stderr < 0.05 * exact  # the check is informative: the estimate is tight


def test_sample_moments():
    with jax.enable_x64(True):
        mu, lam = random_moments(27)
        x = _sample_jit(jax.random.key(2), _diag_from_numpy((mu, lam)), NUM_MC)
        for k in SHAPES:
            xs, m, v = np.asarray(x[k]), mu[k], 1.0 / lam[k]
            assert xs.shape == (NUM_MC,) + m.shape
            # 5 standard errors: sd(mean) = sigma / sqrt(n), sd(var) ~ sigma^2 sqrt(2 / (n - 1)).
            assert np.all(np.abs(xs.mean(axis=0) - m) < 5 * np.sqrt(v / NUM_MC))
            assert np.all(np.abs(xs.var(axis=0, ddof=1) / v - 1.0) < 5 * math.sqrt(2.0 / (NUM_MC - 1)))


def test_sample_is_deterministic_and_per_leaf():
    with jax.enable_x64(True):
        g = random_diag(28)
        key = jax.random.key(3)
        draw = G.sample(key, g)
        assert_tree_equal(G.sample(key, g), draw)
        assert not np.array_equal(G.sample(jax.random.key(4), g)["w"], draw["w"])
        assert jax.tree.structure(draw) == jax.tree.structure(g.precision_mean)
        jax.tree.map(lambda d, m: np.testing.assert_equal(d.shape, m.shape), draw, g.precision_mean)
        # Leaves get independent keys: draws of two leaves with equal shape and moments differ.
        two = _diag_from_numpy(
            (
                {"u": np.zeros((3, 2)), "v": np.zeros((3, 2))},
                {"u": np.ones((3, 2)), "v": np.ones((3, 2))},
            )
        )
        d2 = G.sample(key, two)
        assert not np.array_equal(d2["u"], d2["v"])


# ---------------------------------------------------------------------------------------------
# IsoGaussian == DiagGaussian with the precision broadcast


def test_iso_matches_diag():
    with jax.enable_x64(True):
        ia, ib = random_iso(30), random_iso(31)
        da, db = iso_as_diag_by_hand(ia), iso_as_diag_by_hand(ib)
        assert_tree_equal(G.to_diag(ia), da)
        # product / quotient / damp of two isotropic stay isotropic and agree.
        for op in (G.product, G.quotient, lambda a, b: G.damp(a, b, 0.3)):
            iso_result, diag_result = op(ia, ib), op(da, db)
            assert isinstance(iso_result, G.IsoGaussian)
            assert_tree_equal(iso_as_diag_by_hand(iso_result), diag_result)
            # Mixing the kinds promotes to diagonal with the same values.
            assert_tree_equal(op(ia, db), diag_result)
            assert_tree_equal(op(da, ib), diag_result)
        iso_power = G.power(ia, 1.7)
        assert isinstance(iso_power, G.IsoGaussian)
        assert_tree_equal(iso_as_diag_by_hand(iso_power), G.power(da, 1.7))
        kl_want = G.kl(da, db)
        for p, q in ((ia, ib), (ia, db), (da, ib)):
            np.testing.assert_allclose(G.kl(p, q), kl_want, rtol=1e-14)  # same ops, same order
        x = random_diag(32).precision_mean
        np.testing.assert_allclose(G.log_prob(ia, x), G.log_prob(da, x), rtol=1e-14)  # same ops
        np.testing.assert_allclose(G.entropy(ia), G.entropy(da), rtol=1e-14)  # same ops
        key = jax.random.key(5)
        assert_tree_equal(G.sample(key, ia), G.sample(key, da))
        assert_tree_equal(G.mean(ia), G.mean(da))
        variance = G.variance(ia)
        assert np.ndim(variance) == 0
        assert_tree_equal(jax.tree.map(lambda e: np.full(e.shape, variance), ia.precision_mean), G.variance(da))


# ---------------------------------------------------------------------------------------------
# hypothesis: random pytrees (1-3 leaves, random shapes), precisions in [1e-3, 1e3]

# A small alphabet of shapes (ranks 0-3): the ops are elementwise, and each new shape costs an
# XLA compile per primitive, which would dominate the run time.
_shape = st.sampled_from([(), (2,), (3, 2), (2, 1, 2)])


def _leaf(shape, low, high):
    return hnp.arrays(np.float64, shape, elements=st.floats(low, high, allow_subnormal=False))


def _mean_leaf(shape):
    # Means within 1e-30 of zero are excluded: mean * precision can then be subnormal, and XLA on
    # the CPU flushes subnormals to zero, which is the platform's arithmetic, not the algebra's.
    elements = st.floats(-10.0, 10.0, allow_subnormal=False).filter(lambda v: v == 0.0 or abs(v) > 1e-30)
    return hnp.arrays(np.float64, shape, elements=elements)


@st.composite
def moments_pair(draw):
    """Two (mean, precision) numpy pytrees over one random structure of 1-3 leaves."""
    shapes = draw(st.lists(_shape, min_size=1, max_size=3))

    def structure(leaves):
        return {"first": leaves[0], "rest": list(leaves[1:])}

    def one():
        mus = [draw(_mean_leaf(s)) for s in shapes]
        lams = [draw(_leaf(s, 1e-3, 1e3)) for s in shapes]
        return structure(mus), structure(lams)

    return one(), one()


@given(moments_pair())
def test_property_product_quotient_round_trip(pair):
    with jax.enable_x64(True):
        a, b = _diag_from_numpy(pair[0]), _diag_from_numpy(pair[1])
        got = G.quotient(G.product(a, b), b)
        assert_within_rounding(got, a, abs_sum(a, b), ulps=2)  # two roundings, as above
        assert bool(G.is_proper(got))


@given(moments_pair(), st.floats(0.0, 1.0))
def test_property_power_and_damp(pair, a):
    with jax.enable_x64(True):
        q, r = _diag_from_numpy(pair[0]), _diag_from_numpy(pair[1])
        got = G.product(G.power(q, a), G.power(q, 1.0 - a))
        # a x + (1 - a) x with a in [0, 1]: at most four roundings of terms bounded by |x|.
        assert_within_rounding(got, q, abs_sum(q), ulps=4)
        assert_tree_equal(G.power(q, 1.0), q)
        assert_tree_equal(G.damp(q, r, 1.0), r)
        assert_tree_equal(G.damp(q, r, 0.0), q)
        assert bool(G.is_proper(G.damp(q, r, a)))


@given(moments_pair())
def test_property_moments_round_trip(pair):
    with jax.enable_x64(True):
        mu, lam = pair[0]
        g = G.from_moments(_as_jax(mu), _as_jax(jax.tree.map(np.reciprocal, lam)))
        assert_tree_close(g.precision, lam, rtol=2 * EPS64)  # 1 / (1 / x): two roundings
        mu2, var2 = G.to_moments(g)
        assert_tree_close(mu2, mu, rtol=4 * EPS64)  # a few roundings
        assert_tree_close(var2, jax.tree.map(np.reciprocal, lam), rtol=4 * EPS64)  # a few roundings
        assert float(G.kl(g, g)) == 0.0


@given(moments_pair(), st.floats(1e-3, 1e3))
def test_property_iso_round_trip(pair, lam):
    with jax.enable_x64(True):
        mu = _as_jax(pair[0][0])
        g = G.from_moments(mu, 1.0 / lam)
        assert isinstance(g, G.IsoGaussian)
        mu2, var2 = G.to_moments(g)
        assert_tree_close(mu2, mu, rtol=4 * EPS64)  # a few roundings
        np.testing.assert_allclose(var2, 1.0 / lam, rtol=4 * EPS64)  # a few roundings
        other = _diag_from_numpy(pair[1])
        got = G.quotient(G.product(g, other), other)
        assert_within_rounding(got, G.to_diag(g), abs_sum(G.to_diag(g), other), ulps=2)  # two roundings


# ---------------------------------------------------------------------------------------------
# jit and vmap on every function

NUM_BATCH = 3


def _inputs(seed):
    rng = np.random.default_rng(100 + seed)
    a = rng.normal(size=(3, 3))
    return {
        "a": random_diag(seed),
        "b": random_diag(seed + 50),
        "ia": random_iso(seed + 60),
        "x": random_diag(seed + 70).precision_mean,
        "t": jnp.asarray(np.float64(0.1 + 0.2 * seed)),
        "key": jax.random.key(seed),
        "vec": jnp.asarray(rng.normal(size=3)),
        "cov": jnp.asarray(a @ a.T + np.eye(3)),
    }


CASES = {
    "product": lambda i: G.product(i["a"], i["b"]),
    "product_mixed": lambda i: G.product(i["ia"], i["b"]),
    "quotient": lambda i: G.quotient(i["a"], i["b"]),
    "power": lambda i: G.power(i["a"], i["t"]),
    "power_iso": lambda i: G.power(i["ia"], i["t"]),
    "damp": lambda i: G.damp(i["a"], i["b"], i["t"]),
    "difference": lambda i: G.difference(i["a"], i["b"]),
    "to_moments": lambda i: G.to_moments(i["a"]),
    "to_moments_iso": lambda i: G.to_moments(i["ia"]),
    "mean": lambda i: G.mean(i["ia"]),
    "variance": lambda i: G.variance(i["a"]),
    "from_moments": lambda i: G.from_moments(i["x"], G.variance(i["a"])),
    "from_moments_iso": lambda i: G.from_moments(i["x"], i["t"]),
    "to_diag": lambda i: G.to_diag(i["ia"]),
    "uniform_like": lambda i: G.uniform_like(i["x"]),
    "is_proper": lambda i: G.is_proper(G.quotient(i["a"], i["b"])),
    "proper_mask": lambda i: G.proper_mask(G.quotient(i["a"], i["b"])),
    # One sampling case only: each threefry program takes about a second to compile. The
    # num_samples path is compiled by _sample_jit; Iso draws equal Diag draws (test above).
    "sample": lambda i: G.sample(i["key"], i["a"]),
    "log_prob": lambda i: G.log_prob(i["a"], i["x"]),
    "kl": lambda i: G.kl(i["a"], i["b"]),
    "kl_mixed": lambda i: G.kl(i["ia"], i["a"]),
    "entropy": lambda i: G.entropy(i["ia"]),
    "project_full_to_diag": lambda i: G.project_full_to_diag(i["vec"], i["cov"]),
}


def _all_cases(inputs):
    return {name: fn(inputs) for name, fn in CASES.items()}


@pytest.fixture(scope="module")
def jit_vmap_results():
    """Every case evaluated eagerly per item and by ``jit(vmap(.))`` over the stacked items.

    One program holds all cases, so the module pays one compile rather than one per case.
    Float64, sharing eager compiles with the tests above; float32 is covered by
    test_dtypes_are_kept_under_x64_and_strict_promotion.
    """
    with jax.enable_x64(True):
        items = [_inputs(s) for s in range(NUM_BATCH)]
        eager = [_all_cases(i) for i in items]
        batched = jax.jit(jax.vmap(_all_cases))(ftree.stack(items))
    unbatched = [jax.tree.map(lambda x, k=k: x[k], batched) for k in range(NUM_BATCH)]
    return eager, unbatched


@pytest.mark.parametrize("name", sorted(CASES))
def test_jit_and_vmap(name, jit_vmap_results):
    eager, unbatched = jit_vmap_results
    for e, v in zip(eager, unbatched, strict=True):
        got, want = v[name], e[name]
        assert jax.tree.structure(got) == jax.tree.structure(want)
        for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
            assert g.dtype == w.dtype and g.shape == w.shape
            if g.dtype == jnp.bool_:
                np.testing.assert_array_equal(g, w)
            else:
                # XLA may fuse and reorder float64 arithmetic under jit / vmap.
                np.testing.assert_allclose(g, w, rtol=1e-12, atol=1e-12)


# ---------------------------------------------------------------------------------------------
# float32 (the library's default dtype) and optax interplay


def test_dtypes_are_kept_under_x64_and_strict_promotion():
    g = random_diag(42, dtype=np.float32)

    def run(g, a64, iso):
        return {
            "power": G.power(g, a64),
            "damp": G.damp(g, g, a64),
            "product": G.product(g, g),
            "to_diag": G.to_diag(iso),
            "product_mixed": G.product(iso, g),
            "sample": G.sample(jax.random.key(0), g),
            "from_moments_iso": G.from_moments(G.mean(g), 2.0).precision_mean,
            "log_prob": G.log_prob(g, G.mean(g)),
            "kl": G.kl(g, g),
            "entropy": G.entropy(g),
        }

    with jax.enable_x64(True), jax.numpy_dtype_promotion("strict"):
        a64 = jnp.asarray(np.float64(0.3))
        iso = G.IsoGaussian(g.precision_mean, jnp.asarray(np.float64(2.0)))
        # Traced once under jit: the promotion rules are those of eager mode, at one compile.
        results = jax.jit(run)(g, a64, iso)
    for name, r in results.items():
        for leaf in jax.tree.leaves(r):
            assert leaf.dtype == jnp.float32, name


def test_gaussians_are_pytrees_for_optax():
    # FedEP's server step: optax on natural parameters (docs/algorithms.md §7.7 step 5); SGD(lr) with a
    # negated delta adds lr * delta, i.e. the product with delta^lr.
    g, step = random_diag(40, dtype=np.float32), random_diag(41, dtype=np.float32)

    @jax.jit
    def server_step(g, step):
        opt = optax.sgd(0.5)
        updates, _ = opt.update(optax.tree.scale(-1.0, step), opt.init(g), g)
        return optax.apply_updates(g, updates), G.product(g, G.power(step, 0.5))

    new, want = server_step(g, step)
    assert isinstance(new, G.DiagGaussian)
    assert_gaussian_close(new, want, rtol=1e-6)  # float32, and XLA may reassociate
