"""The natural-gradient diagonal local VI (fedbayes.inference.vi_natural): one step is the formula, a
linear-Gaussian client reaches its exact mean-field posterior, a logistic-regression client the
central mean-field VI optimum, and the refusals."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.flatten_util import ravel_pytree

from fedbayes import gaussian
from fedbayes.data.batches import ClientData
from fedbayes.evaluation.reference import mean_field_vi
from fedbayes.gaussian import DiagGaussian
from fedbayes.inference import LocalTrainer
from fedbayes.inference.vi_natural import natural_diag_vi, natural_step
from fedbayes.models import init_params, loss_fn, make_model

LAMBDA = 0.7


def _client(x, y, epochs=2):
    """``epochs`` epochs in order, with a batch's room after them (as the simulator's layout leaves)."""
    n = len(x)
    return ClientData(jnp.asarray(x), jnp.asarray(y), jnp.tile(jnp.arange(n, dtype=jnp.int32), epochs + 1), jnp.int32(0), jnp.int32(n))


def _linear(n=30, d=3, seed=5):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, d)).astype(np.float32)
    y = (x @ rng.normal(size=d) + 0.3 * rng.normal(size=n)).astype(np.float32)
    apply = lambda p, xs: xs @ p["w"]  # noqa: E731
    loss = lambda p, key, xs, ys, mask: 0.5 * jnp.sum(mask * (apply(p, xs) - ys) ** 2) / jnp.maximum(jnp.sum(mask), 1.0)  # noqa: E731
    cavity = gaussian.from_moments({"w": jnp.asarray(rng.normal(size=d), jnp.float32)}, {"w": jnp.asarray(rng.uniform(0.3, 1.0, size=d), jnp.float32)})
    return x, y, apply, loss, cavity


def test_one_step_is_the_formula():
    """Squared error on a linear model, one full batch: the antithetic pair's mean gradient is the
    gradient at the mean and the GGN diagonal is ``sum_n x_n^2`` wherever it is taken, so one call
    of one step is ``P' = (1 - b) P + b (P_c + sum x^2)``, ``m' = m - b (X^T (X m - y) + P_c (m - mu_c)) / P'``."""
    x, y, apply, loss, cavity = _linear()
    n, b = len(x), 0.3
    start = gaussian.from_moments({"w": jnp.asarray([0.2, -0.1, 0.4])}, {"w": jnp.asarray([0.5, 2.0, 1.0])})
    fit = natural_diag_vi(LocalTrainer(loss, optax.sgd(0.0), 1, n), apply_fn=apply, task="regression", step_size=b, passes=1, min_steps=1)
    q, info = jax.jit(fit)(jax.random.key(0), start, cavity, _client(x, y))
    x64, y64 = x.astype(np.float64), y.astype(np.float64)
    m0, p0 = np.array([0.2, -0.1, 0.4]), 1.0 / np.array([0.5, 2.0, 1.0])
    pc, mc = np.asarray(cavity.precision["w"], np.float64), np.asarray(gaussian.mean(cavity)["w"], np.float64)
    p1 = (1 - b) * p0 + b * (pc + np.sum(x64**2, axis=0))
    m1 = m0 - b * (x64.T @ (x64 @ m0 - y64) + pc * (m0 - mc)) / p1
    np.testing.assert_allclose(np.asarray(q.precision["w"]), p1, rtol=1e-5)
    np.testing.assert_allclose(np.asarray(gaussian.mean(q)["w"]), m1, rtol=1e-5, atol=1e-6)
    assert int(info["steps"]) == 1
    # the step alone, on a pytree
    m, p = natural_step({"a": jnp.asarray(1.0)}, {"a": jnp.asarray(2.0)}, {"a": jnp.asarray(0.5)}, {"a": jnp.asarray(3.0)},
                        {"a": jnp.asarray(1.0)}, {"a": jnp.asarray(-1.0)}, 10.0, 0.5)  # fmt: skip
    assert float(p["a"]) == pytest.approx(0.5 * 2.0 + 0.5 * (1.0 + 30.0))
    assert float(m["a"]) == pytest.approx(1.0 - 0.5 * (10.0 * 0.5 + 1.0 * 2.0) / float(p["a"]))


@pytest.mark.parametrize("batch_size", [30, 8])
def test_a_linear_gaussian_client_reaches_its_exact_mean_field_posterior(batch_size):
    """The tilted distribution of a linear-Gaussian client is Gaussian: its mean-field VI optimum has
    the exact mean and the precision ``diag(Lambda)``. With the whole data in one batch both are
    reached to round-off (the GGN diagonal is exact wherever it is taken, the antithetic pair makes
    the gradient exact, and the mean's step is a damped Jacobi iteration of the normal equations);
    with minibatches of 8 the tail average is within a few percent (each batch's GGN is its own
    examples', unbiased for the mean over the data)."""
    x, y, apply, loss, cavity = _linear()
    fit = natural_diag_vi(LocalTrainer(loss, optax.sgd(0.0), 1, batch_size), apply_fn=apply, task="regression", step_size=0.5, passes=1, min_steps=200)
    q, _ = jax.jit(fit)(jax.random.key(1), cavity, cavity, _client(x, y, epochs=1))
    x64 = x.astype(np.float64)
    lam = np.diag(np.asarray(cavity.precision["w"], np.float64)) + x64.T @ x64
    mean = np.linalg.solve(lam, np.asarray(cavity.precision_mean["w"], np.float64) + x64.T @ y)
    exact = batch_size == len(x)
    np.testing.assert_allclose(np.asarray(q.precision["w"]), np.diag(lam), rtol=1e-5 if exact else 0.05)
    np.testing.assert_allclose(np.asarray(gaussian.mean(q)["w"]), mean, atol=(1e-5 if exact else 0.05) * np.abs(mean).max())


def test_a_logistic_regression_client_reaches_the_central_mean_field_optimum():
    """For a GLM with its canonical link the GGN is the Hessian, so the fixed point is the
    mean-field VI optimum (fedbayes.evaluation.reference.mean_field_vi, float64 Newton on the ELBO);
    the whole data in one batch, so only the draws are noise (the tail average takes it out)."""
    rng = np.random.default_rng(0)
    n, d = 60, 3
    x = rng.normal(size=(n, d)).astype(np.float32)
    y = (x @ rng.normal(size=d) + 0.8 * rng.normal(size=n) > 0).astype(np.int32)
    model = make_model("logreg", 2)
    params = init_params(model, jax.random.key(1), (d,))
    apply = lambda p, xs: model.apply({"params": p}, xs)  # noqa: E731
    prior = DiagGaussian(jax.tree.map(jnp.zeros_like, params), jax.tree.map(lambda p: jnp.full_like(p, LAMBDA), params))
    fit = natural_diag_vi(
        LocalTrainer(loss_fn(model, "classification"), optax.sgd(0.0), 1, 60), apply_fn=apply, samples=8, step_size=0.2, passes=1, min_steps=100
    )
    q, info = jax.jit(fit)(jax.random.key(0), prior, prior, _client(x, y))
    mean, var = mean_field_vi(apply, jax.tree.map(jnp.zeros_like, params), x, y, LAMBDA)
    m_ref, v_ref = ravel_pytree(mean)[0], ravel_pytree(var)[0]
    np.testing.assert_allclose(ravel_pytree(gaussian.mean(q))[0], m_ref, atol=0.03 * float(jnp.abs(m_ref).max()))  # measured 1.3%
    np.testing.assert_allclose(ravel_pytree(gaussian.variance(q))[0], v_ref, rtol=0.05)  # measured 1.9%
    assert int(info["steps"]) == 100 and np.isfinite(float(info["loss"]))


def test_bad_settings_are_refused():
    trainer = LocalTrainer(None, optax.sgd(0.1), 1, 1)
    for kwargs, field in (({"samples": 0}, "samples"), ({"passes": 0}, "passes"), ({"min_steps": -1}, "min_steps"),
                          ({"step_size": 0.0}, "step_size"), ({"step_size": 1.5}, "step_size"), ({"init_std": 0.0}, "init_std"),
                          ({"task": "next_word"}, "curvature")):  # fmt: skip
        with pytest.raises(ValueError, match=field):
            natural_diag_vi(trainer, apply_fn=None, **kwargs)
