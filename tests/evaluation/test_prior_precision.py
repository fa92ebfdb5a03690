"""The post-hoc prior precision of Laplace-family posteriors (fedbayes.evaluation.prior_precision):
the marginal-likelihood objective against the exact evidence of a linear-Gaussian model, and both
searches against a brute-force grid of the same objective."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fedbayes.evaluation import prior_precision as pp
from fedbayes.evaluation.evaluators import marginal_metrics


def _posterior(seed: int, size: int = 24):
    """A posterior N(theta*, 1 / (G + delta)) with some coordinates the data leave alone (G = 0)
    and one point coordinate (variance 0)."""
    rng = np.random.default_rng(seed)
    g = rng.exponential(rng.uniform(0.5, 50.0), size) * (rng.random(size) < 0.7)
    delta = float(10 ** rng.uniform(-2, 2))
    mean = {"w": jnp.asarray(rng.normal(0, rng.uniform(0.1, 2.0), size), jnp.float32), "b": jnp.asarray(rng.normal(0, 1, 2), jnp.float32)}
    var = {"w": jnp.asarray(1.0 / (g + delta), jnp.float32), "b": jnp.asarray([1.0 / (3.0 + delta), 0.0], jnp.float32)}
    return mean, var, delta


def test_curvature_and_the_swapped_prior():
    mean, var, delta = _posterior(0)
    curv = pp.curvature(var, delta)
    assert np.isinf(curv["b"][1]) and np.all(np.asarray(curv["w"]) >= 0)
    np.testing.assert_allclose(curv["b"][0], 3.0, rtol=1e-5)
    back = pp.with_prior_precision(curv, delta)
    np.testing.assert_allclose(back["w"], var["w"], rtol=1e-5)
    assert back["b"][1] == 0.0  # a point coordinate stays a point
    wider = pp.with_prior_precision(curv, delta / 10)
    assert np.all(np.asarray(wider["w"]) > np.asarray(var["w"]))


@pytest.mark.parametrize("delta", [0.05, 1.0, 20.0])
def test_the_marginal_likelihood_is_the_exact_evidence_of_a_linear_gaussian_model(delta):
    """For y = X theta + noise with orthogonal columns, the posterior is exactly N(theta*,
    diag(1 / (G + delta))) with G = diag(X^T X) / sigma^2, and Laplace's evidence is exact: it must
    equal log N(y; 0, sigma^2 I + X X^T / delta), computed here without the package."""
    rng = np.random.default_rng(1)
    n, p, sigma = 30, 5, 0.7
    q, _ = np.linalg.qr(rng.normal(size=(n, p)))
    x = q * rng.uniform(1.0, 6.0, p)  # orthogonal, unequal columns
    y = x @ rng.normal(0, 1, p) + sigma * rng.normal(size=n)
    g = np.sum(x * x, axis=0) / sigma**2
    theta = (x.T @ y / sigma**2) / (g + delta)  # the MAP (diagonal system)
    resid = y - x @ theta
    log_lik = -0.5 * (resid @ resid) / sigma**2 - 0.5 * n * np.log(2 * np.pi * sigma**2)
    cov = sigma**2 * np.eye(n) + x @ x.T / delta
    _, logdet = np.linalg.slogdet(cov)
    exact = -0.5 * (y @ np.linalg.solve(cov, y)) - 0.5 * logdet - 0.5 * n * np.log(2 * np.pi)

    got = pp.log_marginal_likelihood({"t": jnp.asarray(theta, jnp.float32)}, {"t": jnp.asarray(g, jnp.float32)}, delta, log_likelihood=log_lik)
    np.testing.assert_allclose(float(got), exact, rtol=2e-5)
    # the curvature read back from the posterior's variance gives the same number
    var = {"t": jnp.asarray(1.0 / (g + delta), jnp.float32)}
    again = pp.log_marginal_likelihood({"t": jnp.asarray(theta, jnp.float32)}, pp.curvature(var, delta), delta, log_likelihood=log_lik)
    np.testing.assert_allclose(float(again), exact, rtol=1e-4)


def _fine_grid(objective, center: float, points: int = 24001):
    """Brute force: the objective on a fine grid over the search's range (step 1.2e-3 in ln)."""
    half = pp.GRID_DECADES * np.log(10.0)
    ts = jnp.asarray(np.log(center) + np.linspace(-half, half, points), jnp.float32)
    values = np.asarray(jax.jit(jax.vmap(objective))(ts))
    best = int(np.argmax(values))
    return float(ts[best]), float(values[best])


@settings(max_examples=12, deadline=None)
@given(seed=st.integers(0, 10_000))
def test_the_marglik_search_picks_the_grids_value(seed):
    mean, var, delta = _posterior(seed)
    curv = pp.curvature(var, delta)
    objective = lambda t: pp.log_marginal_likelihood(mean, curv, jnp.exp(t))  # noqa: E731
    t_grid, v_grid = _fine_grid(objective, delta)
    found = float(pp.marglik_prior_precision(mean, var, delta))
    assert abs(np.log(found) - t_grid) < 5e-3, (found, np.exp(t_grid))
    assert float(objective(jnp.log(found))) >= v_grid - 1e-4 * abs(v_grid)
    # the optimum of a concave objective in log delta: MacKay's fixed point delta = gamma / ||theta||^2
    g = np.asarray(curv["w"], np.float64)
    b0 = float(curv["b"][0])
    gamma = np.sum(g / (g + found)) + b0 / (b0 + found)
    norm = float(np.sum(np.square(mean["w"])) + np.square(mean["b"][0]))
    np.testing.assert_allclose(found, gamma / norm, rtol=1e-3)


def test_the_validation_search_picks_the_grids_value():
    """The validation NLL of a softmax regression's sampled predictive, on the same draws for every
    candidate: the search's delta' is the fine grid's, and lies inside the range (an overconfident
    mean, so some width helps)."""
    rng = np.random.default_rng(3)
    n, d, c = 80, 3, 3
    x = rng.normal(size=(n, d)).astype(np.float32)
    w_true = rng.normal(size=(d, c))
    y = np.argmax(x @ w_true + 0.7 * rng.gumbel(size=(n, c)), axis=1).astype(np.int32)
    mean = {"w": jnp.asarray(3.0 * w_true, jnp.float32), "b": jnp.zeros(c, jnp.float32)}  # overconfident
    delta = 1.0  # the biases: no curvature, so a tiny delta' is too wide
    var = {"w": jnp.asarray(1.0 / (rng.uniform(5, 50, (d, c)) + delta), jnp.float32), "b": jnp.full((c,), 1.0 / delta, jnp.float32)}
    apply_fn = lambda p, xs: xs @ p["w"] + p["b"][None]  # noqa: E731
    metrics = marginal_metrics(apply_fn, x, y, num_samples=8, batch_size=n)
    key = jax.random.key(7)
    nll = lambda k, m, v: metrics(k, m, v)["nll"]  # noqa: E731

    tune = pp.make_prior_precision_search("validation", delta, validation_nll=nll)
    new_var, found = tune(key, mean, var)
    curv = pp.curvature(var, delta)
    objective = lambda t: -nll(key, mean, pp.with_prior_precision(curv, jnp.exp(t)))  # noqa: E731
    t_grid, v_grid = _fine_grid(objective, delta, points=4001)
    half = pp.GRID_DECADES * np.log(10.0)
    assert abs(t_grid) < half - 1.0, "the optimum must be inside the range for this test to mean anything"
    assert abs(np.log(float(found)) - t_grid) < 1e-2, (float(found), np.exp(t_grid))
    assert float(objective(jnp.log(found))) >= v_grid - 1e-5
    np.testing.assert_allclose(new_var["w"], 1.0 / (np.asarray(curv["w"]) + float(found)), rtol=1e-5)


def test_fixed_keeps_the_posterior_and_bad_settings_are_one_line():
    mean, var, delta = _posterior(5)
    new_var, chosen = pp.make_prior_precision_search("fixed", delta)(jax.random.key(0), mean, var)
    assert float(chosen) == pytest.approx(delta) and all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(new_var), jax.tree.leaves(var)))
    # marglik: the returned variance is the swapped prior's
    new_var, chosen = pp.make_prior_precision_search("marglik", delta)(jax.random.key(0), mean, var)
    np.testing.assert_allclose(new_var["w"], pp.with_prior_precision(pp.curvature(var, delta), chosen)["w"], rtol=1e-6)
    # no Gaussian coordinate (FedEP's burn-in): delta itself
    zero = jax.tree.map(jnp.zeros_like, var)
    assert float(pp.marglik_prior_precision(mean, zero, delta)) == pytest.approx(delta)
    for call, message in (
        (lambda: pp.make_prior_precision_search("grid", 1.0), "prior_precision search must be one of fixed, marglik, validation; got 'grid'"),
        (lambda: pp.make_prior_precision_search("marglik", 0.0), "must be > 0; got 0.0"),
        (lambda: pp.make_prior_precision_search("validation", 1.0), "the validation search needs validation_nll"),
    ):
        with pytest.raises(ValueError) as exc:
            call()
        assert message in str(exc.value) and "\n" not in str(exc.value)


def test_the_last_layer_subset_keeps_only_the_output_layers_variance():
    from fedbayes.evaluation.evaluators import restrict_to_subset
    from fedbayes.models import init_params, make_model

    params = init_params(make_model("mlp", 3, hidden=(4,)), jax.random.key(0), (5,))
    var = jax.tree.map(jnp.ones_like, params)
    assert restrict_to_subset(var, "all") is var
    last = restrict_to_subset(var, "last_layer")
    assert list(last) == list(params) and list(params)[-1] == "output"
    assert all(float(jnp.sum(v)) == 0.0 for k in params if k != "output" for v in jax.tree.leaves(last[k]))
    assert all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(last["output"]), jax.tree.leaves(var["output"])))
    with pytest.raises(ValueError, match="subset_of_weights must be one of all, last_layer; got 'first'"):
        restrict_to_subset(var, "first")


@pytest.mark.parametrize("seed", [0, 1])
def test_a_low_rank_posterior_is_searched_in_its_own_structure(seed):
    """A low-rank spread (precision diag(d) + U diag(s) U^T): the objective against dense algebra,
    the swapped prior keeps U and s, and the marglik search meets MacKay's fixed point on G's
    eigenvalues."""
    from jax.flatten_util import ravel_pytree

    from fedbayes.gaussian_lowrank import LowRankGaussian

    with jax.enable_x64(True):
        rng = np.random.default_rng(seed)
        size, rank, delta = 12, 3, 2.0
        g_diag = rng.exponential(5.0, size) * (rng.random(size) < 0.7)
        u = np.linalg.qr(rng.normal(size=(size, rank)))[0]
        s = rng.uniform(5.0, 80.0, rank)
        g = np.diag(g_diag) + (u * s) @ u.T  # the curvature, PSD
        mean = {"w": jnp.asarray(rng.normal(0, 0.7, size))}
        spread = LowRankGaussian({"w": jnp.zeros(size)}, {"w": jnp.asarray(g_diag + delta)}, jnp.asarray(u), jnp.asarray(s))
        curv = pp.curvature(spread, delta)
        assert isinstance(curv, pp.LowRankCurvature)
        wider = pp.with_prior_precision(curv, delta / 10)
        np.testing.assert_allclose(np.asarray(wider.diag["w"]), g_diag + delta / 10, rtol=1e-12)
        np.testing.assert_array_equal(np.asarray(wider.factors), u)
        m = np.asarray(ravel_pytree(mean)[0])
        for other in (0.1, 3.0):
            dense = -0.5 * other * m @ m + 0.5 * size * np.log(other) - 0.5 * np.linalg.slogdet(g + other * np.eye(size))[1]
            np.testing.assert_allclose(float(pp.log_marginal_likelihood(mean, curv, other)), dense, rtol=1e-6)  # delta' in float32
        found = float(pp.marglik_prior_precision(mean, spread, delta))
        eig = np.linalg.eigvalsh(g)
        np.testing.assert_allclose(found, np.sum(eig / (eig + found)) / (m @ m), rtol=1e-4)


def test_a_low_rank_layer_marginal_keeps_its_layer_through_the_search():
    """The last layer's marginal of a low-rank posterior: the evidence is the whole structure's,
    and the chosen prior precision gives the marginal of the same layer."""
    from fedbayes import gaussian_lowrank

    rng = np.random.default_rng(2)
    shapes = {"hidden": (6,), "output": (3,)}
    u = np.linalg.qr(rng.normal(size=(9, 2)))[0].astype(np.float32)
    diag = {k: jnp.asarray(rng.uniform(1.5, 4.0, s), jnp.float32) for k, s in shapes.items()}
    joint = gaussian_lowrank.LowRankGaussian({k: jnp.zeros(s) for k, s in shapes.items()}, diag, jnp.asarray(u), jnp.asarray([20.0, 5.0]))
    mean = {k: jnp.asarray(rng.normal(size=s), jnp.float32) for k, s in shapes.items()}
    whole = float(pp.marglik_prior_precision(mean, joint, 1.0))
    layer = pp.make_prior_precision_search("marglik", 1.0)
    spread, chosen = layer(jax.random.key(0), mean, gaussian_lowrank.marginal(joint, "output"))
    np.testing.assert_allclose(float(chosen), whole, rtol=1e-6)
    assert isinstance(spread, gaussian_lowrank.LayerMarginal) and spread.key == "output"
    np.testing.assert_allclose(np.asarray(spread.joint.diag["hidden"]), np.asarray(diag["hidden"]) - 1.0 + whole, rtol=1e-5)
