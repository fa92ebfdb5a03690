"""Full-covariance VI of a tilted distribution (fedbayes.inference.vi_full): both local steps (the
Cholesky one and the natural-gradient one) reach the central optimum of the same objective
(fedbayes.evaluation.reference.full_covariance_vi) on a logistic regression with the prior as the
cavity; the natural step's precision is exact on a linear-Gaussian model, where its mean is the
exact posterior's; the KL in the client's parameters equals gaussian_full.kl; the
parameterisations agree."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.flatten_util import ravel_pytree

from fedbayes import gaussian_full
from fedbayes.data.batches import ClientData
from fedbayes.evaluation.reference import full_covariance_vi as central_full_vi
from fedbayes.gaussian import DiagGaussian
from fedbayes.inference import LocalTrainer
from fedbayes.inference.vi_full import FullVariationalParams, full_covariance_vi, kl_to_full_cavity, natural_full_vi, scale_of, to_full_gaussian
from fedbayes.models import init_params, loss_fn, make_model

LAMBDA = 0.7


def _logistic(n=40, d=3, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, d)).astype(np.float32)
    y = (x @ rng.normal(size=d) + 0.8 * rng.normal(size=n) > 0).astype(np.int32)
    model = make_model("logreg", 2)
    params = init_params(model, jax.random.key(1), (d,))
    return model, params, x, y


@pytest.mark.parametrize("parameterisation", ["log", "softplus"])
def test_the_local_step_reaches_the_central_full_covariance_vi_optimum(parameterisation):
    model, params, x, y = _logistic()
    n, steps = len(x), 4000
    data = ClientData(jnp.asarray(x), jnp.asarray(y), jnp.tile(jnp.arange(n, dtype=jnp.int32), steps), jnp.int32(0), jnp.int32(n))
    trainer = LocalTrainer(loss_fn(model, "classification"), optax.sgd(optax.exponential_decay(0.1, steps, 0.01)), steps, n)
    prior = gaussian_full.to_full(DiagGaussian(jax.tree.map(jnp.zeros_like, params), jax.tree.map(lambda p: jnp.full_like(p, LAMBDA), params)))
    fit = full_covariance_vi(trainer, samples=8, parameterisation=parameterisation)
    q, info = jax.jit(fit)(jax.random.key(0), prior, prior, data)
    mean, cov = central_full_vi(lambda p, xs: model.apply({"params": p}, xs), params, x, y, LAMBDA)
    np.testing.assert_allclose(ravel_pytree(gaussian_full.mean(q))[0], ravel_pytree(mean)[0], atol=0.03)
    np.testing.assert_allclose(np.asarray(gaussian_full.covariance(q)), cov, atol=0.05 * np.abs(cov).max())
    assert int(info["steps"]) == steps


def _client(x, y):
    """One epoch in order, with a batch's room after it (as the simulator's layout leaves)."""
    n = len(x)
    return ClientData(jnp.asarray(x), jnp.asarray(y), jnp.tile(jnp.arange(n, dtype=jnp.int32), 2), jnp.int32(0), jnp.int32(n))


def _prior(params, precision):
    return gaussian_full.to_full(DiagGaussian(jax.tree.map(jnp.zeros_like, params), jax.tree.map(lambda p: jnp.full_like(p, precision), params)))


def test_the_natural_step_reaches_the_central_full_covariance_vi_optimum():
    model, params, x, y = _logistic()
    prior = _prior(params, LAMBDA)
    trainer = LocalTrainer(loss_fn(model, "classification"), optax.sgd(0.0), 1, 16)
    apply = lambda p, xs: model.apply({"params": p}, xs)  # noqa: E731
    fit = natural_full_vi(trainer, apply_fn=apply, samples=32, steps=40)
    q, info = jax.jit(fit)(jax.random.key(0), prior, prior, _client(x, y))
    mean, cov = central_full_vi(apply, params, x, y, LAMBDA)
    np.testing.assert_allclose(ravel_pytree(gaussian_full.mean(q))[0], ravel_pytree(mean)[0], atol=0.03)
    np.testing.assert_allclose(np.asarray(gaussian_full.covariance(q)), cov, atol=0.05 * np.abs(cov).max())
    assert int(info["steps"]) == 40 and np.isfinite(float(info["loss"]))


def test_the_natural_step_is_exact_in_its_precision_on_a_linear_gaussian_model():
    """Squared error on a linear model: the GGN is X^T X wherever it is taken, so after the first
    step at beta = 1 every precision is the posterior's to round-off; the antithetic draws make the
    expected gradient exact, so the mean, a Newton step on a quadratic, is the posterior's too."""
    rng = np.random.default_rng(5)
    n, d = 30, 3
    x = rng.normal(size=(n, d)).astype(np.float32)
    y = (x @ rng.normal(size=d) + 0.3 * rng.normal(size=n)).astype(np.float32)
    params = {"w": jnp.zeros(d)}
    apply = lambda p, xs: xs @ p["w"]  # noqa: E731
    loss = lambda p, key, xs, ys, mask: 0.5 * jnp.sum(mask * (apply(p, xs) - ys) ** 2) / jnp.maximum(jnp.sum(mask), 1.0)  # noqa: E731
    cavity = gaussian_full.from_moments({"w": jnp.asarray(rng.normal(size=d), jnp.float32)}, jnp.eye(d) * 2.0)
    fit = natural_full_vi(LocalTrainer(loss, optax.sgd(0.0), 1, 7), apply_fn=apply, task="regression", samples=8, steps=12, step_size=1.0)
    q, _ = jax.jit(fit)(jax.random.key(2), _prior(params, 1.0), cavity, _client(x, y))
    lam_exact = np.asarray(cavity.precision) + x.T.astype(np.float64) @ x
    mean_exact = np.linalg.solve(lam_exact, np.asarray(cavity.precision_mean["w"]) + x.T @ y)
    np.testing.assert_allclose(np.asarray(q.precision), lam_exact, rtol=1e-4)
    np.testing.assert_allclose(np.asarray(gaussian_full.mean(q)["w"]), mean_exact, rtol=1e-4, atol=1e-5)


def test_the_kl_in_the_clients_parameters_is_gaussian_full_kl():
    rng = np.random.default_rng(3)
    d = 4
    m = rng.normal(size=(d, d))
    cavity = gaussian_full.from_moments(jnp.asarray(rng.normal(size=d)), jnp.asarray(m @ m.T + np.eye(d)))
    raw = jnp.asarray(np.tril(rng.normal(size=(d, d))) + 5.0 * np.triu(np.ones((d, d)), 1))  # the upper triangle is unused
    for parameterisation in ("log", "softplus"):
        vp = FullVariationalParams(jnp.asarray(rng.normal(size=d)), raw)
        scale = np.asarray(scale_of(vp, parameterisation))
        assert np.all(np.triu(scale, 1) == 0) and np.all(np.diag(scale) > 0)
        q = to_full_gaussian(vp, parameterisation)
        np.testing.assert_allclose(np.asarray(gaussian_full.covariance(q)), scale @ scale.T, rtol=1e-4, atol=1e-5)
        np.testing.assert_allclose(float(kl_to_full_cavity(cavity, parameterisation)(vp)), float(gaussian_full.kl(q, cavity)), rtol=1e-4)


def test_bad_settings_are_refused():
    trainer = LocalTrainer(None, optax.sgd(0.1), 1, 1)
    for kwargs, field in (({"samples": 0}, "samples"), ({"parameterisation": "exp"}, "parameterisation"), ({"init_std": 0.0}, "init_std")):
        with pytest.raises(ValueError, match=field):
            full_covariance_vi(trainer, **kwargs)
    for kwargs, field in (({"samples": 0}, "samples"), ({"steps": 0}, "steps"), ({"step_size": 1.5}, "step_size"), ({"task": "next_word"}, "curvature")):
        with pytest.raises(ValueError, match=field):
            natural_full_vi(trainer, apply_fn=None, **kwargs)
