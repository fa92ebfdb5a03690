"""VBNN (Ozer et al. 2022 (VBNN aggregation), docs/algorithms.md §12): aggregation rules (12.4) in both variants,
variational layers, client objective, variances that learn."""

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import digits_vbnn_run
from hypothesis import given, settings
from hypothesis import strategies as st

from fedbayes import gaussian, protocol, tree
from fedbayes.aggregators.variational import RULES, VARIANTS, aggregate, aggregate_params, variational_rule
from fedbayes.algorithms.fedavg import fedavg
from fedbayes.algorithms.server_opt import make_server_optimizer
from fedbayes.algorithms.vbnn import variational_objective, vbnn
from fedbayes.data.batches import ClientData
from fedbayes.evaluation.variational import predictive_log_probs, predictive_metrics
from fedbayes.inference import LocalTrainer
from fedbayes.models import init_params, make_model
from fedbayes.models.variational import (
    VariationalDense,
    apply_with_key,
    kl_to_prior,
    logvar_quantiles,
    merge_variational,
    paper_clamp,
    paper_init,
    split_variational,
    std_norm,
)

EXACT_RULES = ("eaa", "gaa", "aalv", "cf")
BAYES_FIXED_RULES = ("eaa", "gaa", "aalv", "cf", "merging")  # exact (no Monte Carlo)


def _clients(seed, k, shape=(3, 4), lo=-8.0, hi=8.0):
    km, ka = jax.random.split(jax.random.key(seed))
    mean = jax.random.normal(km, (k, *shape))
    log_var = jax.random.uniform(ka, (k, *shape), minval=lo, maxval=hi)
    return mean, log_var


weights_strategy = st.lists(st.floats(0.05, 10.0), min_size=1, max_size=8)


# ----- 12.4 item 1: one client -------------------------------------------------------------------


@given(st.integers(0, 2**16), st.floats(0.1, 10.0), st.sampled_from(VARIANTS))
def test_single_client_returns_its_input(seed, w, variant):
    mean, log_var = _clients(seed, 1)
    for rule in EXACT_RULES:
        m, a = aggregate(rule, mean, log_var, jnp.array([w]), variant=variant)
        # EAA, GAA, AALV: bitwise; CF: e^{-a} then log, float32 rounding (|a| <= 8).
        np.testing.assert_allclose(m, mean[0], rtol=1e-6, atol=1e-6, err_msg=rule)
        np.testing.assert_allclose(a, log_var[0], rtol=0, atol=1e-5, err_msg=rule)


def test_single_client_ppa_within_monte_carlo_error():
    n = 1000
    mean, log_var = _clients(0, 1, shape=(2000,), lo=-4.0, hi=2.0)
    m, a = aggregate("ppa", mean, log_var, jnp.array([1.0]), key=jax.random.key(1), population=n)
    sd = jnp.exp(0.5 * log_var[0])
    # Pooled mean ~ N(mu, sigma^2 / n); pooled 1/n variance ~ sigma^2 chi2_{n-1} / n: log sd sqrt(2/n).
    z_mean = (m - mean[0]) / (sd / math.sqrt(n))
    z_logvar = (a - log_var[0]) / math.sqrt(2.0 / n)
    assert float(jnp.max(jnp.abs(z_mean))) < 5.0
    assert float(jnp.max(jnp.abs(z_logvar))) < 5.0
    assert abs(float(jnp.mean(z_mean))) < 5.0 / math.sqrt(2000)


# ----- 12.4 item 2: identical clients -------------------------------------------------------------


@given(weights_strategy, st.floats(-8.0, 8.0), st.floats(-3.0, 3.0))
def test_identical_clients_paper(weights, alpha, mu):
    k = len(weights)
    w = jnp.array(weights, jnp.float32)
    beta = np.asarray(w) / float(np.sum(np.asarray(w, np.float64)))
    mean = jnp.full((k, 5), mu, jnp.float32)
    log_var = jnp.full((k, 5), alpha, jnp.float32)
    var = math.exp(alpha)
    expected = {"eaa": var, "aalv": var, "gaa": var * float(np.sum(beta**2)), "cf": float(np.max(beta)) * var, "merging": var}
    for rule, v in expected.items():
        m, a = aggregate(rule, mean, log_var, w, variant="paper")
        np.testing.assert_allclose(m, mu, rtol=1e-5, atol=1e-5, err_msg=rule)
        np.testing.assert_allclose(a, math.log(v), rtol=0, atol=2e-5, err_msg=rule)


def test_identical_clients_fvba_gaa_and_cf_shrink_by_k_paper():
    k = 7
    mean, log_var = _clients(3, 1)
    mean, log_var = jnp.repeat(mean, k, 0), jnp.repeat(log_var, k, 0)
    for rule in ("gaa", "cf"):
        _, a = aggregate(rule, mean, log_var, jnp.ones(k), variant="paper")
        np.testing.assert_allclose(a, log_var[0] - math.log(k), atol=2e-5, err_msg=rule)


@settings(max_examples=10, deadline=None)
@given(weights_strategy, st.lists(st.floats(-25.0, 5.0), min_size=1, max_size=4), st.floats(-3.0, 3.0), st.integers(1, 12))
def test_identical_clients_are_a_fixed_point_round_after_round(weights, alphas, mu, rounds):
    """``bayes``: K clients that agree give back their posterior, and feeding the result back as
    every client's, round after round, stays there (docs/algorithms.md §12.3, the fixed point)."""
    k = len(weights)
    w = jnp.array(weights, jnp.float32)
    start_m = jnp.full((len(alphas),), mu, jnp.float32)
    start_a = jnp.array(alphas, jnp.float32)
    for rule in BAYES_FIXED_RULES:
        m, a = start_m, start_a
        for _ in range(rounds):
            m, a = aggregate(rule, jnp.broadcast_to(m, (k, *m.shape)), jnp.broadcast_to(a, (k, *a.shape)), w)
        np.testing.assert_allclose(m, start_m, rtol=1e-5, atol=1e-5, err_msg=rule)
        np.testing.assert_allclose(a, start_a, rtol=3e-6 * rounds, atol=1e-5 * rounds, err_msg=rule)  # float32 rounding only


def test_identical_clients_ppa_stays_within_monte_carlo_error():
    k, n, rounds = 5, 1000, 10
    w = jnp.array([1.0, 2.0, 3.0, 4.0, 10.0])
    m, a = jnp.zeros(2000), jnp.full((2000,), -5.0)
    for r in range(rounds):
        m, a = aggregate("ppa", jnp.broadcast_to(m, (k, 2000)), jnp.broadcast_to(a, (k, 2000)), w, key=jax.random.key(r), population=n)
    # the pooled 1/N variance: log-variance a random walk of sd sqrt(2/N) per round, bias log((N-1)/N)
    assert abs(float(jnp.mean(a)) + 5.0) < 5 * math.sqrt(2.0 / n * rounds / 2000) + rounds / n
    assert float(jnp.std(a)) < 3 * math.sqrt(2.0 * rounds / n)


def test_paper_gaa_and_cf_collapse_round_after_round():
    """The paper's GAA and CF shrink agreeing clients' variance by sum beta^2 or beta_max every
    round: without the clamp's floor (stored values) the log-variance falls linearly."""
    k, rounds = 10, 5
    w = jnp.ones(k)
    for rule, per_round in (("gaa", math.log(0.1)), ("cf", math.log(0.1))):
        a = jnp.full((3,), 4.0)
        for _ in range(rounds):
            _, a = aggregate(rule, jnp.zeros((k, 3)), jnp.broadcast_to(a, (k, 3)), w, variant="paper")
        np.testing.assert_allclose(a, 4.0 + rounds * per_round, atol=1e-4, err_msg=rule)


@settings(max_examples=20, deadline=None)
@given(st.integers(2, 8), st.integers(0, 2**16))
def test_bayes_rules_differ_and_are_ordered(k, seed):
    """With disagreeing variances: CF (harmonic mean) < AALV (geometric) < GAA (squared mean of
    sigma) < EAA (arithmetic) < merging (plus the means' spread); CF's mean is precision-weighted."""
    mean, log_var = _clients(seed, k, shape=(50,), lo=-12.0, hi=0.0)
    w = jax.random.uniform(jax.random.key(seed + 1), (k,), minval=0.1, maxval=1.0)
    out = {r: aggregate(r, mean, log_var, w) for r in BAYES_FIXED_RULES}
    order = ("cf", "aalv", "gaa", "eaa", "merging")
    for lo, hi in zip(order, order[1:]):
        gap = out[hi][1] - out[lo][1]
        assert bool(jnp.all(gap > -1e-5)), (lo, hi, float(jnp.min(gap)))  # ordered everywhere
        assert float(jnp.mean(gap)) > 1e-2, (lo, hi, float(jnp.mean(gap)))  # and distinct
    beta = w / jnp.sum(w)
    np.testing.assert_allclose(out["aalv"][0], jnp.sum(beta[:, None] * mean, 0), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(out["gaa"][1], 2 * jnp.log(jnp.sum(beta[:, None] * jnp.exp(0.5 * log_var), 0)), rtol=1e-5, atol=1e-5)
    assert float(jnp.max(jnp.abs(out["cf"][0] - out["aalv"][0]))) > 1e-3


@settings(max_examples=20, deadline=None)
@given(st.integers(1, 6), st.integers(0, 2**16), st.floats(0.2, 5.0))
def test_bayes_cf_is_the_posterior_of_the_union(k, seed, prior_var):
    """A conjugate Gaussian model per weight: client k's likelihood N(m_k, 1/h_k) and n_k examples.
    Its optimum under its share of the KL (``F_k``, algorithms.vbnn) has precision
    ``(N/n_k) h_k + 1/s^2`` and mean ``(N/n_k) h_k m_k / precision``; CF with ``beta = n_k / N`` of
    these is the exact posterior of all the data under the prior once."""
    rng = np.random.default_rng(seed)
    n = rng.integers(1, 100, size=k).astype(np.float64)
    h = rng.uniform(0.5, 50.0, size=(k, 7)) * n[:, None]
    m = rng.normal(size=(k, 7))
    big_n = n.sum()
    lam_k = (big_n / n)[:, None] * h + 1.0 / prior_var
    mu_k = (big_n / n)[:, None] * h * m / lam_k
    with jax.enable_x64(True):
        got_m, got_a = aggregate("cf", jnp.asarray(mu_k), jnp.asarray(-np.log(lam_k)), jnp.asarray(n))
        lam = h.sum(0) + 1.0 / prior_var
        np.testing.assert_allclose(np.exp(-np.asarray(got_a)), lam, rtol=1e-10)
        np.testing.assert_allclose(np.asarray(got_m), (h * m).sum(0) / lam, rtol=1e-9, atol=1e-12)


# ----- 12.4 item 3: conflation is the product of Gaussians ------------------------------------------


@given(st.integers(1, 10), st.integers(0, 2**16))
def test_cf_uniform_is_product_of_gaussians(k, seed):
    mean, log_var = _clients(seed, k, lo=-4.0, hi=4.0)
    m, a = aggregate("cf", mean, log_var, jnp.ones(k), variant="paper")
    product = functools.reduce(gaussian.product, [gaussian.from_moments(mean[i], jnp.exp(log_var[i])) for i in range(k)])
    want_mean, want_var = gaussian.to_moments(product)
    np.testing.assert_allclose(m, want_mean, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(jnp.exp(a), want_var, rtol=1e-4)


# ----- 12.4 item 4: orderings ---------------------------------------------------------------------


@given(weights_strategy, st.integers(0, 2**16))
def test_gaa_and_aalv_variances_at_most_eaa(weights, seed):
    mean, log_var = _clients(seed, len(weights))
    w = jnp.array(weights, jnp.float32)
    _, eaa = aggregate("eaa", mean, log_var, w, variant="paper")
    for rule in ("gaa", "aalv"):
        _, a = aggregate(rule, mean, log_var, w, variant="paper")
        assert bool(jnp.all(a <= eaa + 1e-5)), rule


# ----- 12.4 item 5: PPA approaches the moment-matched mixture ------------------------------------------


def test_ppa_approaches_merging_as_population_grows():
    k = 5
    mean, log_var = _clients(4, k, shape=(4000,), lo=-3.0, hi=1.0)
    w = jnp.array([1.0, 2.0, 3.0, 4.0, 10.0])
    m_merge, a_merge = aggregate("merging", mean, log_var, w)
    errors = []
    for n in (20, 200, 20000):
        m, a = aggregate("ppa", mean, log_var, w, key=jax.random.key(n), population=n)
        errors.append((float(jnp.sqrt(jnp.mean((m - m_merge) ** 2))), float(jnp.sqrt(jnp.mean((a - a_merge) ** 2)))))
    assert errors[0][0] > errors[1][0] > errors[2][0]
    assert errors[0][1] > errors[1][1] > errors[2][1]
    # At N = 20000 the root-mean-square log-variance error is about sqrt(2 / N) plus the floor's bias.
    assert errors[2][1] < 0.05 and errors[2][0] < 0.05


def test_ppa_keeps_every_client():
    # beta_k N < 1 for the small clients: each still gets one draw (docs/algorithms.md §12.5), so their far-away
    # means move the pool; with floor(beta N) = 0 they would vanish.
    k = 11
    mean = jnp.concatenate([jnp.zeros((1, 200)), jnp.full((k - 1, 200), 100.0)])
    log_var = jnp.full((k, 200), -8.0)
    w = jnp.array([1000.0] + [1.0] * (k - 1))
    m, _ = aggregate("ppa", mean, log_var, w, key=jax.random.key(0), population=100)
    np.testing.assert_allclose(m, 100.0 * 10 / 109, rtol=2e-3)  # 99 + 10 draws (floor(100 * 1000/1010) = 99)


# ----- 12.5: conflation in precision form does not underflow ----------------------------------------


def test_cf_forty_clients_at_minimum_log_variance_float32():
    k = 40
    mean = jax.random.normal(jax.random.key(5), (k, 100))
    log_var = jnp.full((k, 100), -8.0, jnp.float32)
    m, a = aggregate("cf", mean, log_var, jnp.ones(k, jnp.float32), variant="paper")
    assert m.dtype == jnp.float32 and a.dtype == jnp.float32
    assert bool(jnp.all(jnp.isfinite(m))) and bool(jnp.all(jnp.isfinite(a)))
    np.testing.assert_allclose(a, -8.0 - math.log(k), atol=1e-5)  # beta_max / (K e^8) = e^-8 / K
    np.testing.assert_allclose(m, jnp.mean(mean, axis=0), rtol=1e-5, atol=1e-6)
    # The reference code's product of variances is 0 in float32 here.
    assert float(jnp.prod(jnp.exp(log_var[:, 0]))) == 0.0
    # bayes: at the models' guard, -30 (precisions e^30 each), finite and exact
    m, a = aggregate("cf", mean, jnp.full((k, 100), -30.0, jnp.float32), jnp.ones(k, jnp.float32))
    assert bool(jnp.all(jnp.isfinite(m))) and bool(jnp.all(jnp.isfinite(a)))
    np.testing.assert_allclose(a, -30.0, atol=1e-5)


# ----- 12.4 item 6: deterministic parameters -------------------------------------------------------


def _vcnn_clients(k):
    model = make_model("cnn", 10, variational=True)
    params = init_params(model, jax.random.key(0), (12, 12, 1))
    keys = jax.random.split(jax.random.key(1), k)
    return model, params, jax.vmap(lambda kk: jax.tree.map(lambda p: p + 0.1 * jax.random.normal(kk, p.shape), params))(keys)


@pytest.mark.parametrize("rule", RULES)
def test_deterministic_leaves_aggregate_as_fedavg(rule):
    k = 4
    _, params, stacked = _vcnn_clients(k)
    w = jnp.array([3.0, 1.0, 0.0, 6.0])
    out = aggregate_params(rule, stacked, w, jax.random.key(2))
    _, _, det_out = split_variational(out)
    _, _, det_in = split_variational(stacked)
    want = tree.weighted_mean(det_in, w)
    jax.tree.map(np.testing.assert_array_equal, det_out, want)  # bitwise
    assert set(det_out["conv_0"]) == {"kernel", "bias"} and det_out["dense_0"]["kernel_mean"] is None
    # FedAvg's server step (SGD, lr 1) on the deterministic parameters: theta - mean(theta - theta_k).
    fed = fedavg(LocalTrainer(None, optax.sgd(0.1), 1, 1), make_server_optimizer("sgd", 1.0))
    state = fed.server_init(None, params)
    deltas = jax.tree.map(lambda c, p: p[None] - c, stacked, params)
    fed_params = fed.server_update(None, state, fed.aggregator(None, deltas, w))[0].params
    for name in ("conv_0", "conv_1"):
        np.testing.assert_allclose(out[name]["kernel"], fed_params[name]["kernel"], rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(out["dense_0"]["bias"], fed_params["dense_0"]["bias"], rtol=1e-6, atol=1e-6)


def test_absent_client_contributes_nothing_even_if_not_finite():
    mean, log_var = _clients(6, 3)
    bad_mean = mean.at[1].set(jnp.nan)
    bad_lv = log_var.at[1].set(jnp.inf)
    w = jnp.array([1.0, 0.0, 2.0])
    for rule, variant in ((r, v) for r in RULES for v in VARIANTS):
        key = jax.random.key(0)
        want = aggregate(rule, mean[jnp.array([0, 2])], log_var[jnp.array([0, 2])], w[jnp.array([0, 2])], key=key, variant=variant)
        got = aggregate(rule, bad_mean, bad_lv, w, key=key, variant=variant)
        assert bool(jnp.all(jnp.isfinite(got[0]))) and bool(jnp.all(jnp.isfinite(got[1]))), rule
        if rule != "ppa":  # ppa draws per client slot, so its noise differs; finite is the point
            np.testing.assert_allclose(got[0], want[0], rtol=1e-6, atol=1e-6, err_msg=rule)
            np.testing.assert_allclose(got[1], want[1], rtol=1e-6, atol=1e-6, err_msg=rule)


def test_aggregate_accepts_pytrees_and_rejects_bad_input():
    mean, log_var = _clients(7, 3)
    tm = {"a": mean, "b": {"c": mean[:, 0]}}
    tl = {"a": log_var, "b": {"c": log_var[:, 0]}}
    m, a = aggregate("gaa", tm, tl, jnp.ones(3))
    m0, a0 = aggregate("gaa", mean[:, 0], log_var[:, 0], jnp.ones(3))
    np.testing.assert_array_equal(m["b"]["c"], m0)
    np.testing.assert_array_equal(a["b"]["c"], a0)
    with pytest.raises(ValueError, match="aggregation must be one of"):
        aggregate("median", mean, log_var, jnp.ones(3))
    with pytest.raises(ValueError, match="needs a key"):
        aggregate("ppa", mean, log_var, jnp.ones(3))
    with pytest.raises(ValueError, match="population"):
        aggregate("ppa", mean, log_var, jnp.ones(3), key=jax.random.key(0), population=0)
    with pytest.raises(ValueError, match="leading client axis"):
        aggregate("eaa", mean, log_var, jnp.ones(2))
    with pytest.raises(ValueError, match="same structure"):
        aggregate("eaa", tm, {"a": log_var}, jnp.ones(3))
    with pytest.raises(ValueError, match="aggregation must be one of"):
        variational_rule("mean")
    with pytest.raises(ValueError, match="variant must be one of"):
        aggregate("eaa", mean, log_var, jnp.ones(3), variant="bfl")
    with pytest.raises(ValueError, match="accumulation: 'reference_code' .* variant 'paper' only"):
        variational_rule("gaa", accumulation="reference_code")


# ----- the naming convention -------------------------------------------------------------------


def test_split_and_merge_round_trip():
    params = {
        "layer": {"kernel_mean": jnp.ones((2, 3)), "kernel_logvar": jnp.zeros((2, 3)), "bias": jnp.ones(3)},
        "other": {"w_mean": jnp.ones(2)},  # no partner: deterministic
    }
    means, log_vars, det = split_variational(params)
    assert list(means) == [("layer", "kernel")] and list(log_vars) == [("layer", "kernel")]
    assert jax.tree.leaves(det)[0].shape in ((3,), (2,)) and len(jax.tree.leaves(det)) == 2
    back = merge_variational(means, log_vars, det)
    jax.tree.map(np.testing.assert_array_equal, back, params)


def test_std_norm_and_kl():
    params = {"l": {"kernel_mean": jnp.array([[0.5, -1.0]]), "kernel_logvar": jnp.array([[math.log(0.25), -20.0]]), "bias": jnp.ones(2)}}
    clamped = np.array([0.25, math.exp(-8.0)])  # the published clamp
    np.testing.assert_allclose(std_norm(params, clamp=True), math.sqrt(clamped.sum()), rtol=1e-6)
    np.testing.assert_allclose(std_norm(params), math.sqrt(0.25 + math.exp(-20.0)), rtol=1e-6)
    mu = np.array([0.5, -1.0])
    kl = lambda var: 0.5 * np.sum(var + mu**2 - 1.0 - np.log(var))  # noqa: E731
    np.testing.assert_allclose(kl_to_prior(params), kl(np.array([0.25, math.exp(-20.0)])), rtol=1e-5)  # no clamp
    np.testing.assert_allclose(kl_to_prior(paper_clamp(params)), kl(clamped), rtol=1e-5)
    assert logvar_quantiles(params, (0.0, 1.0)) == (-20.0, pytest.approx(math.log(0.25)))


def test_fan_in_prior():
    params = {"l": {"kernel_mean": jnp.full((4, 2), 0.5), "kernel_logvar": jnp.full((4, 2), math.log(0.1)), "bias": jnp.ones(2)}}
    s2, var = 0.25, 0.1  # fan_in 4
    want = 8 * 0.5 * (var / s2 + 0.25 / s2 - 1.0 - math.log(var / s2))
    np.testing.assert_allclose(kl_to_prior(params, "fan_in"), want, rtol=1e-5)
    np.testing.assert_allclose(kl_to_prior(params, 0.25), want, rtol=1e-5)
    with pytest.raises(ValueError, match="prior_variance"):
        kl_to_prior(params, "unit")
    with pytest.raises(ValueError, match="prior_variance"):
        vbnn(LocalTrainer(None, optax.sgd(0.1), 1, 4), lambda p, k, x: x, prior_variance=-1.0, total_examples=10)


def test_paper_variant_initialises_and_predicts_as_the_published_code():
    model = make_model("mlp", 3, variational=True, hidden=(50,))
    params = init_params(model, jax.random.key(0), (40,))
    algo = vbnn(LocalTrainer(None, optax.sgd(0.1), 1, 4), apply_with_key(model), variant="paper")
    state = algo.server_init(jax.random.key(1), params)
    stored = split_variational(state.params)[1]
    flat = jnp.concatenate([v.ravel() for v in stored.values()])
    np.testing.assert_allclose(float(jnp.mean(flat)), -9.0, atol=1e-3)
    np.testing.assert_allclose(float(jnp.std(flat)), 1e-3, rtol=0.1)
    for v in split_variational(algo.server_params(state))[1].values():
        np.testing.assert_array_equal(v, -8.0)  # evaluated as the forward pass sees them
    bayes = vbnn(LocalTrainer(None, optax.sgd(0.1), 1, 4), apply_with_key(model), total_examples=100)
    jax.tree.map(np.testing.assert_array_equal, bayes.server_params(bayes.server_init(jax.random.key(1), params)), params)


# ----- the layer -----------------------------------------------------------------------------------


def test_variational_dense_initialisation():
    layer = VariationalDense(300)
    p = layer.init(jax.random.key(0), jnp.zeros((1, 400)))["params"]
    assert set(p) == {"kernel_mean", "kernel_logvar", "bias"}
    np.testing.assert_allclose(float(jnp.std(p["kernel_mean"])), 1 / math.sqrt(400), rtol=0.02)
    np.testing.assert_allclose(p["kernel_logvar"], math.log(0.01 / 400), rtol=1e-6)  # a tenth of the means' sd
    np.testing.assert_array_equal(p["bias"], 0.0)


def test_local_reparameterisation_matches_weight_sampling():
    """Same output mean and variance as sampling W ~ N(mu, sigma^2) and computing a W + b.

    S = 20000 draws with fixed keys; per output unit the sample means agree within 5 standard
    errors of their difference, and the sample variances within 6% (5 x sqrt(2 / S) = 5% each,
    plus both sides' noise at 4 sigma)."""
    s, din, dout = 20000, 6, 4
    layer = VariationalDense(dout)
    a = jax.random.normal(jax.random.key(0), (1, din))
    p = layer.init(jax.random.key(1), a)["params"]
    p = {
        "kernel_mean": jax.random.normal(jax.random.key(2), (din, dout)),
        "kernel_logvar": jax.random.uniform(jax.random.key(3), (din, dout), minval=-3.0, maxval=1.0),
        "bias": jnp.arange(dout, dtype=jnp.float32),
    }
    keys = jax.random.split(jax.random.key(4), s)
    local = jax.vmap(lambda k: layer.apply({"params": p}, a, rngs={"noise": k})[0])(keys)
    sd = jnp.exp(0.5 * p["kernel_logvar"])
    weights = p["kernel_mean"][None] + sd[None] * jax.random.normal(jax.random.key(5), (s, din, dout))
    sampled = jnp.einsum("i,sio->so", a[0], weights) + p["bias"][None]
    var_exact = jnp.square(a[0]) @ jnp.exp(p["kernel_logvar"]) + 1e-8
    se = jnp.sqrt(2 * var_exact / s)
    assert bool(jnp.all(jnp.abs(local.mean(0) - sampled.mean(0)) < 5 * se))
    np.testing.assert_allclose(local.var(0), sampled.var(0), rtol=0.06)
    np.testing.assert_allclose(local.var(0), var_exact, rtol=0.05)
    np.testing.assert_allclose(local.mean(0), a[0] @ p["kernel_mean"] + p["bias"], atol=float(5 * jnp.max(se)))


def test_noise_is_present_and_keyed():
    model = make_model("mlp", 3, variational=True, hidden=(8,))
    params = init_params(model, jax.random.key(0), (5,))
    f = apply_with_key(model)
    x = jnp.ones((2, 5))
    np.testing.assert_array_equal(f(params, jax.random.key(1), x), f(params, jax.random.key(1), x))
    assert not np.array_equal(f(params, jax.random.key(1), x), f(params, jax.random.key(2), x))


def test_make_model_variational():
    with pytest.raises(ValueError, match="variational"):
        make_model("logreg", 3, variational=True)
    cnn = make_model("cnn", 10, variational=True)
    p = init_params(cnn, jax.random.key(0), (28, 28, 1))
    assert set(p["dense_0"]) == {"kernel_mean", "kernel_logvar", "bias"}
    assert set(p["conv_0"]) == {"kernel", "bias"}
    assert p["dense_0"]["kernel_mean"].shape == (784, 120)


# ----- objective, algorithm, predictions ---------------------------------------------------------------


def test_objective_is_cross_entropy_plus_kl_share():
    model = make_model("mlp", 3, variational=True, hidden=(4,))
    params = init_params(model, jax.random.key(0), (5,))
    apply = apply_with_key(model)
    x = jax.random.normal(jax.random.key(1), (6, 5))
    y = jnp.array([0, 1, 2, 0, 1, 2])
    mask = jnp.array([1.0, 1, 1, 1, 0, 0])
    key = jax.random.key(3)
    ce = lambda p: optax.softmax_cross_entropy_with_integer_labels(apply(p, key, x), y)[:4].mean()  # noqa: E731
    # bayes: the client's share n_k / N of the KL, per example KL / N, whatever n_k
    obj = variational_objective(apply, total_examples=400)
    np.testing.assert_allclose(obj(params, key, x, y, mask, 50), ce(params) + kl_to_prior(params) / 400, rtol=1e-6)
    # paper: the whole KL at every client (KL / n_k), both terms on clamped log-variances
    paper = variational_objective(apply, variant="paper")
    clamped = paper_clamp(params)
    np.testing.assert_allclose(paper(params, key, x, y, mask, 50), ce(clamped) + kl_to_prior(clamped) / 50, rtol=1e-6)
    with pytest.raises(ValueError, match="total_examples"):
        variational_objective(apply)
    cold = variational_objective(apply, total_examples=400, kl_weight=0.1)
    np.testing.assert_allclose(cold(params, key, x, y, mask, 50), ce(params) + 0.1 * kl_to_prior(params) / 400, rtol=1e-6)


def test_log_variance_gradient_is_nonzero_at_initialisation():
    """The objective's gradient reaches every log-variance at the default initialisation (bayes),
    and none of them under the published code's init and clamp (paper)."""
    model = make_model("mlp", 10, variational=True, hidden=(8, 8))
    params = init_params(model, jax.random.key(0), (20,))
    apply = apply_with_key(model)
    x = jax.random.normal(jax.random.key(1), (32, 20))
    y = jax.random.randint(jax.random.key(2), (32,), 0, 10)
    mask = jnp.ones(32)
    grad = jax.grad(variational_objective(apply, total_examples=6000))(params, jax.random.key(3), x, y, mask, 600)
    _, g_lv, _ = split_variational(grad)
    assert len(g_lv) == 3
    for name, g in g_lv.items():
        assert bool(jnp.all(g != 0)), name
        assert bool(jnp.all(jnp.isfinite(g))), name
    # the data term alone reaches them too (the first layer's inputs are non-zero)
    data_grad = jax.grad(variational_objective(apply, total_examples=10**30))(params, jax.random.key(3), x, y, mask, 600)
    assert bool(jnp.all(split_variational(data_grad)[1][("hidden_0", "kernel")] != 0))
    paper_params = paper_init(jax.random.key(4), params)  # what the paper variant's server_init does
    grad = jax.grad(variational_objective(apply, variant="paper"))(paper_params, jax.random.key(3), x, y, mask, 600)
    for name, g in split_variational(grad)[1].items():
        assert bool(jnp.all(g == 0)), name


def test_predictive_is_mean_of_softmaxes():
    model = make_model("mlp", 3, variational=True, hidden=(4,))
    params = init_params(model, jax.random.key(0), (5,))
    apply = apply_with_key(model)
    x = jax.random.normal(jax.random.key(1), (7, 5))
    key = jax.random.key(2)
    got = jnp.exp(predictive_log_probs(apply, params, key, x, num_samples=4))
    want = jnp.mean(jnp.stack([jax.nn.softmax(apply(params, jax.random.fold_in(key, s), x)) for s in range(4)]), 0)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-7)
    out = predictive_metrics(apply, params, key, x, jnp.zeros(7, jnp.int32), num_samples=3, batch_size=3)
    assert set(out) == {"accuracy", "nll", "ece", "std_norm", "std_norm_clamped"}
    with pytest.raises(ValueError, match="num_samples"):
        predictive_log_probs(apply, params, key, x, num_samples=0)


@pytest.mark.parametrize("weighting", ["uniform", "examples"])
def test_vbnn_learns_digits(weighting):
    apply, params, data = digits_vbnn_run(aggregation="gaa", sim_kwargs={"weighting": weighting})
    metrics = predictive_metrics(apply, params, jax.random.key(9), data.x_test, data.y_test)
    assert metrics["accuracy"] > 0.8, metrics
    assert np.isfinite(metrics["nll"]) and 0 <= metrics["ece"] <= 1


def test_vbnn_rejects_a_deterministic_model_and_keeps_params_when_all_rejected():
    model = make_model("mlp", 3, hidden=(4,))
    params = init_params(model, jax.random.key(0), (5,))
    trainer = LocalTrainer(None, optax.sgd(0.1), 1, 4)
    algo = vbnn(trainer, lambda p, k, x: model.apply({"params": p}, x), total_examples=10)
    with pytest.raises(ValueError, match="variational model"):
        algo.server_init(jax.random.key(0), params)
    vmodel = make_model("mlp", 3, hidden=(4,), variational=True)
    vparams = init_params(vmodel, jax.random.key(0), (5,))
    algo = vbnn(trainer, apply_with_key(vmodel), aggregation="cf", total_examples=10)
    state = algo.server_init(jax.random.key(0), vparams)
    stacked = jax.tree.map(lambda p: jnp.stack([p + 1.0, p - 1.0]), vparams)
    k0, k1 = protocol.server_key(0, 0), protocol.server_key(0, 1)
    new, _, _ = protocol.server_step(k0, algo, state, stacked, jnp.zeros(2))
    jax.tree.map(np.testing.assert_array_equal, new.params, vparams)
    ppa = vbnn(trainer, apply_with_key(vmodel), aggregation="ppa", total_examples=10)
    s0 = ppa.server_init(jax.random.key(0), vparams)
    s1, _, _ = protocol.server_step(k0, ppa, s0, stacked, jnp.ones(2))
    again, _, _ = protocol.server_step(k0, ppa, s0, stacked, jnp.ones(2))
    jax.tree.map(np.testing.assert_array_equal, s1.params, again.params)  # keyed by the round's server key
    s2, _, _ = protocol.server_step(k1, ppa, s1, stacked, jnp.ones(2))
    assert not np.array_equal(s1.params["output"]["kernel_mean"], s2.params["output"]["kernel_mean"])
    with pytest.raises(ValueError, match="prior_variance"):
        vbnn(trainer, apply_with_key(vmodel), prior_variance=0.0, total_examples=10)
    with pytest.raises(ValueError, match="total_examples"):
        vbnn(trainer, apply_with_key(vmodel))
    with pytest.raises(ValueError, match="logvar_lr"):
        vbnn(trainer, apply_with_key(vmodel), total_examples=10, logvar_lr=0.0)
    with pytest.raises(ValueError, match="kl_weight"):
        vbnn(trainer, apply_with_key(vmodel), variant="paper", kl_weight=0.5)


def test_aalv_averages_stored_log_variances():
    # Ozer et al. 2022 (VBNN aggregation)'s code averages every parameter, alpha included, without the clamp.
    mean = jnp.zeros((2, 3))
    log_var = jnp.array([[-9.0, -12.0, 9.0], [-11.0, -4.0, 11.0]])
    for variant in VARIANTS:
        _, a = aggregate("aalv", mean, log_var, jnp.array([1.0, 1.0]), variant=variant)
        np.testing.assert_allclose(a, [-10.0, -8.0, 10.0])
    _, a = aggregate("eaa", mean, log_var, jnp.array([1.0, 1.0]), variant="paper")
    np.testing.assert_allclose(a, [-8.0, np.log(0.5 * (np.exp(-8.0) + np.exp(-4.0))), 8.0], rtol=1e-6)


def test_config_variational():
    from fedbayes.config.schema import ModelConfig, RunConfig

    assert ModelConfig(name="cnn", variational=True).variational
    with pytest.raises(ValueError, match="model.variational"):
        ModelConfig(name="logreg", variational=True)
    with pytest.raises(ValueError, match="model.variational"):
        RunConfig(model={"name": "cnn", "variational": True})
    cfg = RunConfig(algorithm={"name": "vbnn"}, model={"name": "mlp", "variational": True})
    assert (cfg.algorithm.variant, cfg.algorithm.aggregation, cfg.algorithm.logvar_lr) == ("bayes", "cf", None)
    paper = {"name": "vbnn", "variant": "paper", "accumulation": "reference_code"}
    assert RunConfig(algorithm=paper, model={"name": "mlp", "variational": True}).algorithm.accumulation == "reference_code"
    with pytest.raises(ValueError, match="algorithm.accumulation"):
        RunConfig(algorithm={"name": "vbnn", "accumulation": "reference_code"}, model={"name": "mlp", "variational": True})


def _reference_code_loop(rule, mu, alpha, beta):
    """Ozer et al. 2022's published accumulation, written as its loop over clients (numpy)."""
    clamp = lambda a: np.clip(a, -8.0, 8.0)  # noqa: E731
    mean = np.sum(beta[:, None] * mu, axis=0)
    s = None
    for k in range(len(beta)):
        if beta[k] == 0:
            continue
        if rule == "eaa":
            term = np.exp(clamp(alpha[k])) * beta[k]
        elif rule == "gaa":
            term = np.exp(clamp(alpha[k])) * beta[k] ** 2
        else:  # merging
            term = ((mean - mu[k]) ** 2 + np.exp(clamp(alpha[k]))) * beta[k]
        s = np.log(term) if s is None else np.log(np.exp(clamp(s)) + term)
    return mean, s


@pytest.mark.parametrize("rule", ["eaa", "gaa", "merging"])
def test_reference_code_accumulation_is_the_published_loop(rule):
    rng = np.random.default_rng(3)
    mu = rng.normal(size=(5, 7))
    alpha = rng.uniform(-10.0, -4.0, size=(5, 7))
    beta = np.array([0.3, 0.0, 0.2, 0.1, 0.4])  # an absent client in the middle is skipped
    with jax.enable_x64(True):
        m, a = aggregate(rule, jnp.asarray(mu), jnp.asarray(alpha), jnp.asarray(beta), accumulation="reference_code", variant="paper")
        em, ea = _reference_code_loop(rule, mu, alpha, beta)
        np.testing.assert_allclose(np.asarray(m), em, rtol=1e-12)
        np.testing.assert_allclose(np.asarray(a), ea, rtol=1e-12)
        # At the clamp floor the running clamp lifts GAA to about e^-8 (Table 4's GAA), where
        # the paper's equation gives e^-8 * sum beta^2.
        floor = jnp.full((4, 3), -9.0)
        w = jnp.full((4,), 0.25)
        _, ref = aggregate("gaa", jnp.zeros((4, 3)), floor, w, accumulation="reference_code", variant="paper")
        _, exact = aggregate("gaa", jnp.zeros((4, 3)), floor, w, variant="paper")
        np.testing.assert_allclose(np.asarray(exact), -8.0 + math.log(0.25), rtol=1e-12)
        np.testing.assert_allclose(np.asarray(ref), math.log(math.exp(-8.0) * (1 + 3 * 0.0625)), rtol=1e-12)
    # The other rules do not depend on it; a wrong name is a clear error.
    for other in ("aalv", "cf"):
        args = (jnp.asarray(mu, jnp.float32), jnp.asarray(alpha, jnp.float32), jnp.asarray(beta, jnp.float32))
        x = aggregate(other, *args, accumulation="reference_code", variant="paper")
        y = aggregate(other, *args, variant="paper")
        assert all(np.array_equal(u, v) for u, v in zip(x, y))
    with pytest.raises(ValueError, match="accumulation must be one of exact, reference_code"):
        aggregate("gaa", jnp.zeros((2, 1)), jnp.zeros((2, 1)), jnp.ones(2), accumulation="code")


# ----- the log-variances' step ---------------------------------------------------------------------


def _natural_problem(n=500.0, lam=1.0, s2=1.0):
    """A per-example objective in the log-variances alone: a quadratic data term whose expected
    curvature per example is ``h_j`` (``E_q[h theta^2 / 2]`` at mean 0) plus the KL share; its
    optimum is ``sigma_j^2 = 1 / (1 / s2 + (n / lam) h_j)``."""
    h = jnp.array([1e-4, 1e-3, 1e-2, 1e-1])

    def f(u):
        v = jnp.exp(u)
        return 0.5 * jnp.sum(h * v) + lam * 0.5 * jnp.sum(v / s2 - 1.0 - u + jnp.log(s2)) / n

    return f, 1.0 / (1.0 / s2 + (n / lam) * h)


def test_natural_logvar_step_relaxes_every_variance_to_its_own_optimum():
    from fedbayes.algorithms.vbnn import natural_logvar_step

    f, target = _natural_problem()
    opt = natural_logvar_step(0.1, 500.0)
    u = jnp.log(jnp.array([1e-3, 10.0, 1e-3, 10.0]))
    state = opt.init(u)
    updates, state = opt.update(jax.grad(f)(u), state)
    # one step: u - lr (sigma^2 P - 1), clipped to one unit (the starts at 10 are 10-500 times too wide)
    want = -0.1 * (jnp.exp(u) / target - 1.0)
    np.testing.assert_allclose(updates, jnp.clip(want, -1.0, 1.0), rtol=1e-5)
    assert float(jnp.min(want)) < -1.0
    for _ in range(300):
        updates, state = opt.update(jax.grad(f)(u), state)
        u = optax.apply_updates(u, updates)
    np.testing.assert_allclose(jnp.exp(u), target, rtol=1e-4)  # optima 50 times apart, each reached


def test_adam_moves_the_log_variances_in_lockstep():
    """What the natural step replaces: Adam's normalised steps move every log-variance by the same
    amount whatever its gradient, so variances whose optima differ 50-fold move together."""
    f, target = _natural_problem()
    assert float(target[0] / target[-1]) > 40
    opt = optax.adam(1e-3)
    u = jnp.full(4, jnp.log(1e-4))
    state = opt.init(u)
    for _ in range(20):
        updates, state = opt.update(jax.grad(f)(u), state)
        u = optax.apply_updates(u, updates)
    moved = np.asarray(u - jnp.log(1e-4))
    np.testing.assert_allclose(moved, moved[0], rtol=1e-3)


def _one_client(hidden, logvar_optimizer):
    model = make_model("mlp", 3, variational=True, hidden=hidden)
    params = init_params(model, jax.random.key(0), (5,))
    x = jax.random.normal(jax.random.key(2), (16, 5), jnp.float32)
    y = (jnp.arange(16) % 3).astype(jnp.int32)
    data = ClientData(x, y, jnp.arange(16, dtype=jnp.int32), jnp.zeros((), jnp.int32), jnp.asarray(16, jnp.int32))
    trainer = LocalTrainer(None, optax.sgd(0.05), 2, 8)
    algo = vbnn(trainer, apply_with_key(model), total_examples=160, logvar_optimizer=logvar_optimizer)
    new, _, _ = algo.client_update(jax.random.key(3), params, None, data)
    return new


@pytest.mark.parametrize("hidden, resolved", [((), "natural"), ((4,), "adam")])
def test_auto_logvar_step_is_natural_on_a_glm_and_adam_on_a_network(hidden, resolved):
    auto = _one_client(hidden, "auto")
    same = _one_client(hidden, resolved)
    other = _one_client(hidden, "adam" if resolved == "natural" else "natural")
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)), auto, same)
    assert not np.allclose(np.asarray(jax.tree.leaves(split_variational(auto)[1])[0]), np.asarray(jax.tree.leaves(split_variational(other)[1])[0]))


def test_logvar_optimizer_settings():
    from fedbayes.algorithms.registry import get
    from fedbayes.config.schema import RunConfig

    model = make_model("mlp", 3, variational=True, hidden=(4,))
    trainer = LocalTrainer(None, optax.sgd(0.1), 1, 4)
    with pytest.raises(ValueError, match="logvar_optimizer"):
        vbnn(trainer, apply_with_key(model), total_examples=10, logvar_optimizer="sgd")
    with pytest.raises(ValueError, match="logvar_optimizer"):
        vbnn(trainer, apply_with_key(model), variant="paper", logvar_optimizer="natural")
    cfg = RunConfig(algorithm={"name": "vbnn"}, model={"name": "mlp", "variational": True})
    assert cfg.algorithm.logvar_optimizer == "auto"
    with pytest.raises(ValueError, match="algorithm.logvar_optimizer"):
        RunConfig(algorithm={"name": "vbnn", "variant": "paper", "logvar_optimizer": "natural"}, model={"name": "mlp", "variational": True})
    # a run folder written before the setting trained its log-variances with Adam
    assert get("vbnn").stored_meaning({"name": "vbnn", "variant": "bayes"}, {})["logvar_optimizer"] == "adam"
