"""Reparameterised VI (:mod:`fedbayes.inference.vi`, PVI's local step; docs/algorithms.md §8): the
KL penalty and the variational parameters on numbers worked by hand, the two gradient estimators
against closed forms and each other, and the local step against the exact mean-field optimum of a
linear-Gaussian tilted objective."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import single_client_data

from fedbayes import gaussian
from fedbayes.algorithms.pvi import pvi
from fedbayes.data.federation import Federation
from fedbayes.gaussian import DiagGaussian
from fedbayes.inference import LocalTrainer
from fedbayes.inference.vi import VariationalParams, kl_to_cavity, reparameterised_vi, std_of, to_gaussian, var_of
from fedbayes.sim.simulator import Simulator

DIM = 3


def _moments(q):
    lam = np.asarray(q.precision, np.float64)
    return np.asarray(q.precision_mean, np.float64) / lam, lam


# ----- on numbers worked by hand ----------------------------------------------------------------------


def test_the_kl_to_a_standard_normal_cavity_is_the_closed_form():
    """KL(N(1, 0.5^2) || N(0, 1)) = log(1 / 0.5) + (0.5^2 + 1^2) / 2 - 1/2 = log 2 + 0.125."""
    vp = VariationalParams(jnp.array([1.0]), jnp.log(jnp.array([0.5])))
    cavity = DiagGaussian(precision_mean=jnp.zeros(1), precision=jnp.ones(1))
    for squared_std in (False, True):
        np.testing.assert_allclose(float(kl_to_cavity(cavity, "log", squared_std=squared_std)(vp)), np.log(2.0) + 0.125, rtol=1e-6)


def test_the_variational_parameters_as_a_gaussian():
    """Mean 2 and std 0.5 (log) are precision 4 and natural mean 8; softplus(0) = log 2."""
    q = to_gaussian(VariationalParams(jnp.array([2.0]), jnp.log(jnp.array([0.5]))), "log")
    np.testing.assert_allclose(np.asarray(q.precision), [4.0], rtol=1e-6)
    np.testing.assert_allclose(np.asarray(q.precision_mean), [8.0], rtol=1e-6)
    soft = VariationalParams(jnp.zeros(1), jnp.zeros(1))
    np.testing.assert_allclose(np.asarray(std_of(soft, "softplus")), [np.log(2.0)], rtol=1e-6)
    np.testing.assert_allclose(np.asarray(var_of(soft, "softplus")), [np.log(2.0) ** 2], rtol=1e-6)


# ----- the local step and its estimators -----------------------------------------------------------------


def _squared_loss(theta, key, xb, yb, m):
    per = 0.5 * jnp.square(xb @ theta - yb)
    return jnp.sum(per * m) / jnp.maximum(jnp.sum(m), 1.0)


def _one_client(x, y, trainer):
    """A one-client federation of ``(x, y)`` and that client's data, laid out for ``trainer``."""
    fed = Federation(x, y, (np.arange(len(y)),))
    sim = Simulator(pvi(trainer, optax.sgd(1.0), prior_precision=1.0, damping=1.0), fed, clients_per_round=1, seed=0)
    return single_client_data(sim, 0, 0)


def _exact_optimum(x, y, cavity):
    """The mean-field optimum of the linear-Gaussian tilted objective: mean (Lambda_c + A)^{-1}
    (eta_c + b), precision Lambda_c + diag(A), with A = X^T X and b = X^T y."""
    prec = np.diag(np.asarray(cavity.precision)) + x.T.astype(np.float64) @ x
    return np.linalg.solve(prec, np.asarray(cavity.precision_mean) + x.T @ y), np.diag(prec)


@pytest.mark.parametrize("parameterisation", ["log", "softplus"])
def test_reparameterised_local_step_finds_the_mean_field_optimum(parameterisation):
    """On a linear-Gaussian client (loss 0.5 (x^T theta - y)^2, so A = X^T X, b = X^T y) with a
    diagonal cavity, the local step's result approaches the exact mean-field optimum of the tilted
    objective: mean (Lambda_c + A)^{-1} (eta_c + b), precision Lambda_c + diag(A). This pins the
    objective's scale (mean loss + KL / n_k)."""
    rng = np.random.default_rng(2)
    n = 40
    x = rng.normal(size=(n, DIM)).astype(np.float32) * np.array([1.0, 0.5, 0.3], np.float32)
    y = (x @ np.array([1.0, -2.0, 0.5]) + 0.3 * rng.normal(size=n)).astype(np.float32)
    trainer = LocalTrainer(_squared_loss, optax.adam(optax.cosine_decay_schedule(0.05, 300)), 300, n)  # decay: converge, not hover
    data = _one_client(x, y, trainer)
    cavity = DiagGaussian(precision_mean=jnp.array([0.5, -1.0, 0.0]), precision=jnp.array([2.0, 1.0, 4.0]))
    fit = jax.jit(reparameterised_vi(trainer, samples=16, parameterisation=parameterisation))
    q, info = fit(jax.random.key(0), cavity, cavity, data)
    want_mean, want_precision = _exact_optimum(x, y, cavity)
    mean, lam = _moments(q)
    # Monte-Carlo gradients (16 samples): 0.03 absolute on the mean, 8% on the precision
    np.testing.assert_allclose(mean, want_mean, atol=0.03)
    np.testing.assert_allclose(lam, want_precision, rtol=0.08)
    assert int(info["steps"]) == 300 and float(info["loss"]) > 0


# ----- the local reparameterisation ---------------------------------------------------------------------


def _vp(params, std, key=None):
    from fedbayes.inference.vi import VariationalParams

    raw = jax.tree.map(lambda p: jnp.full_like(p, np.log(std)), params)
    if key is not None:  # distinct stds per coordinate
        keys = optax.tree.split_key_like(key, params)
        raw = jax.tree.map(lambda k, r: r + 0.5 * jax.random.normal(k, r.shape), keys, raw)
    return VariationalParams(params, raw)


def test_local_reparameterisation_is_unbiased_for_the_expected_loss_and_has_lower_variance():
    """A linear model (one flax Dense) under squared error has E_q[loss] in closed form:
    0.5 ((x M + m - y)^2 + x^2 S^2 + s^2) per example. Both estimators' Monte-Carlo means match it;
    the local one (independent draws per example) has the smaller spread (about half)."""
    from fedbayes.inference.vi import expected_loss, std_of
    from fedbayes.models import init_params, loss_fn, make_model

    model = make_model("linear", 1)
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.normal(size=(16, 4)), jnp.float32)
    y = jnp.asarray(rng.normal(size=16), jnp.float32)
    mask = jnp.ones(16).at[-3:].set(0.0)  # padding counts nowhere
    params = init_params(model, jax.random.key(1), (4,))
    vp = _vp(params, 0.3, jax.random.key(2))
    lf = loss_fn(model, "regression")
    std = std_of(vp, "log")
    z = model.apply({"params": params}, x)
    var = jnp.square(x) @ jnp.square(std["dense"]["kernel"])[:, 0] + jnp.square(std["dense"]["bias"][0])
    want = float(jnp.sum(mask * 0.5 * (jnp.square(z - y) + var)) / jnp.sum(mask))
    keys = jax.random.split(jax.random.key(3), 20000)
    draws = {}
    for est in ("weights", "local"):
        f = expected_loss(lf, samples=1, parameterisation="log", estimator=est)
        draws[est] = np.asarray(jax.jit(jax.vmap(lambda k: f(vp, k, x, y, mask)))(keys))  # noqa: B023
        se = draws[est].std() / np.sqrt(len(keys))
        assert abs(draws[est].mean() - want) < 4 * se, (est, draws[est].mean(), want, se)
    assert draws["local"].std() < 0.7 * draws["weights"].std()  # about half here
    with pytest.raises(ValueError, match="estimator must be one of weights, local"):
        expected_loss(lf, samples=1, parameterisation="log", estimator="flipout")


def test_local_reparameterisation_on_an_mlp_matches_weight_draws_in_expectation():
    """No closed form through a ReLU, but both estimators are unbiased for the same E_q[loss] and
    its gradient: their Monte-Carlo means agree. With every std at zero both are the plain loss."""
    from fedbayes.inference.vi import expected_loss
    from fedbayes.models import init_params, loss_fn, make_model

    model = make_model("mlp", 3, hidden=(8,))
    rng = np.random.default_rng(1)
    x = jnp.asarray(rng.normal(size=(12, 5)), jnp.float32)
    y = jnp.asarray(rng.integers(0, 3, 12), jnp.int32)
    mask = jnp.ones(12)
    params = init_params(model, jax.random.key(4), (5,))
    lf = loss_fn(model, "classification")
    vp = _vp(params, 0.4, jax.random.key(5))
    keys = jax.random.split(jax.random.key(6), 8000)
    est = {}
    for name in ("weights", "local"):
        f = expected_loss(lf, samples=2, parameterisation="log", estimator=name)
        vals, grads = jax.jit(jax.vmap(lambda k: jax.value_and_grad(f)(vp, k, x, y, mask)))(keys)  # noqa: B023
        est[name] = (np.asarray(vals), np.concatenate([np.asarray(g).reshape(len(keys), -1) for g in jax.tree.leaves(grads.mean)], axis=1))
    (vw, gw), (vl, gl) = est["weights"], est["local"]
    se = np.sqrt(vw.var() / len(vw) + vl.var() / len(vl))
    assert abs(vw.mean() - vl.mean()) < 4 * se
    gse = np.sqrt(gw.var(axis=0) / len(gw) + gl.var(axis=0) / len(gl))
    assert np.mean(np.abs(gw.mean(0) - gl.mean(0)) < 4 * gse + 1e-6) > 0.98  # every coordinate, up to a few 4-sigma misses
    exact = float(lf(params, None, x, y, mask))
    tiny = _vp(params, 1e-30)
    for name in ("weights", "local"):
        f = expected_loss(lf, samples=1, parameterisation="log", estimator=name)
        np.testing.assert_allclose(float(f(tiny, jax.random.key(0), x, y, mask)), exact, rtol=1e-6)


@pytest.mark.parametrize("estimator", ["weights", "local"])
def test_local_estimator_finds_the_mean_field_optimum_of_a_flax_linear_model(estimator):
    """The local step on a flax linear regression (kernel and bias: under ``estimator="local"`` all
    of it is drawn in output space) reaches the exact mean-field optimum of its tilted objective
    with either estimator."""
    from fedbayes.models import init_params, loss_fn, make_model

    rng = np.random.default_rng(2)
    n = 40
    x = (rng.normal(size=(n, DIM)) * np.array([1.0, 0.5, 0.3])).astype(np.float32)
    y = (x @ np.array([1.0, -2.0, 0.5]) + 0.7 + 0.3 * rng.normal(size=n)).astype(np.float32)
    model = make_model("linear", 1)
    params = init_params(model, jax.random.key(0), (DIM,))
    # The bias's std starts 9x above its optimum and moves slowest: 2000 steps.
    trainer = LocalTrainer(loss_fn(model, "regression"), optax.adam(optax.cosine_decay_schedule(0.05, 2000)), 2000, n)
    fed = Federation(x, y, (np.arange(n),))
    sim = Simulator(pvi(trainer, optax.sgd(1.0), prior_precision=1.0, damping=1.0, estimator=estimator), fed, clients_per_round=1, seed=0)
    data = single_client_data(sim, 0, 0)
    lam_c = {"dense": {"kernel": jnp.array([[2.0], [1.0], [4.0]]), "bias": jnp.array([0.5])}}
    eta_c = {"dense": {"kernel": jnp.array([[0.5], [-1.0], [0.0]]), "bias": jnp.array([0.2])}}
    assert jax.tree.structure(lam_c) == jax.tree.structure(params)
    cavity = DiagGaussian(precision_mean=eta_c, precision=lam_c)
    fit = jax.jit(reparameterised_vi(trainer, samples=16, parameterisation="log", estimator=estimator))
    q, info = fit(jax.random.key(0), cavity, cavity, data)
    xt = np.concatenate([x, np.ones((n, 1), np.float32)], axis=1).astype(np.float64)  # (kernel, bias)
    lam = np.concatenate([np.asarray(lam_c["dense"]["kernel"])[:, 0], np.asarray(lam_c["dense"]["bias"])])
    eta = np.concatenate([np.asarray(eta_c["dense"]["kernel"])[:, 0], np.asarray(eta_c["dense"]["bias"])])
    prec = np.diag(lam) + xt.T @ xt
    want_mean = np.linalg.solve(prec, eta + xt.T @ y)
    got_lam = np.concatenate([np.asarray(q.precision["dense"]["kernel"])[:, 0], np.asarray(q.precision["dense"]["bias"])])
    got_mean = np.concatenate([np.asarray(q.precision_mean["dense"]["kernel"])[:, 0], np.asarray(q.precision_mean["dense"]["bias"])]) / got_lam
    np.testing.assert_allclose(got_mean, want_mean, atol=0.03)
    np.testing.assert_allclose(got_lam, np.diag(prec), rtol=0.08)
    assert int(info["steps"]) == 2000


@pytest.mark.parametrize("squared_std", [False, True])
@pytest.mark.parametrize("parameterisation", ["log", "softplus"])
def test_the_kl_penalty_in_q_s_own_parameters_equals_the_natural_parameter_kl(parameterisation, squared_std):
    """``kl_to_cavity`` (the local step's penalty) against ``gaussian.kl`` through the natural
    parameters: the same value and gradient, across scales of the standard deviations and cavities."""
    rng = np.random.default_rng(3)
    for spread in (0.1, 1.0, 3.0):
        mean = {"k": jnp.asarray(rng.normal(size=(6, 4)), jnp.float32), "b": jnp.asarray(rng.normal(size=4), jnp.float32)}
        raw = jax.tree.map(lambda m: jnp.asarray(spread * rng.normal(size=m.shape) - 1.0, jnp.float32), mean)
        vp = VariationalParams(mean, raw)
        cavity = gaussian.from_moments(
            jax.tree.map(lambda m: m + jnp.asarray(rng.normal(size=m.shape), jnp.float32), mean),
            jax.tree.map(lambda m: jnp.asarray(np.exp(spread * rng.normal(size=m.shape)), jnp.float32), mean),
        )
        fast = kl_to_cavity(cavity, parameterisation, squared_std=squared_std)
        slow = lambda v: gaussian.kl(to_gaussian(v, parameterisation), cavity)  # noqa: E731
        np.testing.assert_allclose(float(fast(vp)), float(slow(vp)), rtol=1e-5)
        for a, b in zip(jax.tree.leaves(jax.grad(fast)(vp)), jax.tree.leaves(jax.grad(slow)(vp))):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-5)
        assert float(kl_to_cavity(to_gaussian(vp, parameterisation), parameterisation)(vp)) == pytest.approx(0.0, abs=1e-4)  # KL(q || q) = 0


@pytest.mark.parametrize("parameterisation", ["log", "softplus"])
def test_the_variances_are_the_squared_standard_deviations(parameterisation):
    """``var_of`` (``exp(2 raw)`` under the log parameterisation, what the local estimator, the KL
    penalty and ``to_gaussian`` read) is ``std_of`` squared, value and gradient, from tiny to large
    standard deviations."""
    raw = {"k": jnp.linspace(-12.0, 4.0, 33, dtype=jnp.float32)}
    vp = VariationalParams({"k": jnp.zeros(33, jnp.float32)}, raw)
    np.testing.assert_allclose(np.asarray(var_of(vp, parameterisation)["k"]), np.square(np.asarray(std_of(vp, parameterisation)["k"])), rtol=1e-6)
    fast = jax.grad(lambda r: jnp.sum(var_of(VariationalParams(vp.mean, r), parameterisation)["k"]))(raw)["k"]
    slow = jax.grad(lambda r: jnp.sum(jnp.square(std_of(VariationalParams(vp.mean, r), parameterisation)["k"])))(raw)["k"]
    np.testing.assert_allclose(np.asarray(fast), np.asarray(slow), rtol=1e-5)


def test_a_stiff_cavity_on_a_small_client_reaches_the_optimum_where_plain_sgd_diverges():
    """A cavity that has gathered the other clients' sites is stiff for a client of few examples:
    with plain SGD at lr 0.1, ``lr Lambda_c / n = 0.1 * 1000 / 8 = 12.5 > 2`` in one coordinate,
    and the local step blows up there (step_cap 0). The default stiff-step control reaches the
    exact mean-field optimum of the same tilted objective in every coordinate."""
    rng = np.random.default_rng(3)
    n = 8
    x = rng.normal(size=(n, DIM)).astype(np.float32)
    y = (x @ np.array([1.0, -1.0, 0.5]) + 0.3 * rng.normal(size=n)).astype(np.float32)
    trainer = LocalTrainer(_squared_loss, optax.sgd(0.1), 600, n)
    data = _one_client(x, y, trainer)
    cavity = DiagGaussian(precision_mean=jnp.array([0.5, -1.0, 300.0]), precision=jnp.array([2.0, 1.0, 1000.0]))
    plain, _ = jax.jit(reparameterised_vi(trainer, samples=16, estimator="weights", step_cap=0.0))(jax.random.key(0), cavity, cavity, data)
    mean, _ = _moments(plain)
    assert not np.all(np.isfinite(mean)) or np.max(np.abs(mean)) > 1e3
    q, _ = jax.jit(reparameterised_vi(trainer, samples=16, estimator="weights"))(jax.random.key(0), cavity, cavity, data)
    want_mean, want_precision = _exact_optimum(x, y, cavity)
    mean, lam = _moments(q)
    np.testing.assert_allclose(mean, want_mean, atol=0.03)
    np.testing.assert_allclose(lam, want_precision, rtol=0.1)
