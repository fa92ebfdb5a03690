"""PVI with full-covariance (dense) sites: on a linear-Gaussian model, where full-covariance VI is
exact, one client reaches the exact posterior and several clients the exact product, with the
Cholesky client and with the natural-gradient one (the default from a config); the refusals."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import optax
import pytest

from fedbayes import gaussian_full
from fedbayes.algorithms.pvi import FULL_SAMPLES, default_samples, pvi
from fedbayes.config.schema import ConfigError, validate
from fedbayes.data.federation import Federation
from fedbayes.inference import LocalTrainer
from fedbayes.inference.vi_full import natural_full_vi
from fedbayes.runs.export import save_model
from fedbayes.sim.simulator import Simulator

DIM = 3


def _gaussian_problem(num_clients, seed=0):
    """Client k holds one 'example', its Gaussian likelihood exp(-theta^T A_k theta / 2 + b_k^T theta)
    with a dense A_k (correlated parameters): the loss is quadratic, so the tilted distribution is
    Gaussian and full-covariance VI is exact."""
    rng = np.random.default_rng(seed)
    a_mats, b_vecs = [], []
    for _ in range(num_clients):
        m = rng.normal(size=(DIM, DIM))
        a_mats.append(m @ m.T + 0.5 * np.eye(DIM))
        b_vecs.append(rng.normal(size=DIM))
    x = np.concatenate([np.asarray(b_vecs), np.asarray(a_mats).reshape(num_clients, -1)], axis=1).astype(np.float32)
    fed = Federation(x, np.zeros(num_clients, np.int32), tuple(np.array([k]) for k in range(num_clients)))
    return fed, np.asarray(a_mats), np.asarray(b_vecs)


def _quadratic_loss(theta, key, x, y, mask):
    del key, y
    b, a = x[:, :DIM], x[:, DIM:].reshape(-1, DIM, DIM)
    per = 0.5 * jnp.einsum("i,nij,j->n", theta, a, theta) - b @ theta
    return jnp.sum(mask * per) / jnp.maximum(jnp.sum(mask), 1.0)


def _trainer(steps=3000, lr=0.05):
    # a decaying step: the last iterate of the stochastic reparameterisation gradient settles
    return LocalTrainer(_quadratic_loss, optax.sgd(optax.exponential_decay(lr, steps, 0.01)), steps, 1)


def _exact(a_mats, b_vecs, delta):
    prec = delta * np.eye(DIM) + a_mats.sum(0)
    return np.linalg.solve(prec, b_vecs.sum(0)), np.linalg.inv(prec)


def _run(num_clients, rounds, rho, delta=0.7, samples=16):
    fed, a_mats, b_vecs = _gaussian_problem(num_clients)
    algo = pvi(_trainer(), optax.sgd(1.0), prior_precision=delta, damping=rho, samples=samples, covariance="full")
    sim = Simulator(algo, fed, clients_per_round=num_clients, seed=0)
    state = sim.init(jnp.zeros(DIM, jnp.float32))
    for _ in range(rounds):
        state, info = sim.run_round(state)
        assert len(info.rejected) == 0
    return algo, state, _exact(a_mats, b_vecs, delta)


def test_one_client_is_the_exact_posterior_of_a_linear_gaussian_model(tmp_path):
    # one client, rho = 1: cavity = prior, q_g = the local full-covariance VI optimum, here exact
    algo, state, (mean, cov) = _run(1, 1, rho=1.0)
    q = state.server_state.q
    np.testing.assert_allclose(np.asarray(gaussian_full.mean(q)), mean, atol=0.02)
    np.testing.assert_allclose(np.asarray(gaussian_full.covariance(q)), cov, atol=0.03 * np.abs(cov).max())
    assert np.abs(cov - np.diag(np.diag(cov))).max() > 0.1 * np.abs(cov).max()  # the correlations are there to get
    with np.load(save_model(tmp_path / "model.npz", algo, state.server_state)) as z:
        np.testing.assert_array_equal(z["posterior_precision"], np.asarray(q.precision))


def test_several_clients_reach_the_exact_product():
    # PVI's fixed point with exact local steps is the posterior; damped 0.5, 3 clients
    _, state, (mean, cov) = _run(3, 12, rho=0.5)
    q = state.server_state.q
    np.testing.assert_allclose(np.asarray(gaussian_full.mean(q)), mean, atol=0.02)
    np.testing.assert_allclose(np.asarray(gaussian_full.covariance(q)), cov, atol=0.05 * np.abs(cov).max())


def test_the_natural_client_reaches_the_exact_product_of_a_linear_regression():
    """Squared error on a linear model with Gaussian noise: the posterior is Gaussian, and with its
    antithetic draws the natural client's local step is exact, so damped PVI goes to the product."""
    rng = np.random.default_rng(4)
    sizes, delta = (9, 4, 15), 0.7
    x = rng.normal(size=(sum(sizes), DIM)).astype(np.float32)
    x[:, 1] += 0.9 * x[:, 0]  # correlated weights
    y = (x @ rng.normal(size=DIM) + 0.5 * rng.normal(size=len(x))).astype(np.float32)
    bounds = np.cumsum((0,) + sizes)
    fed = Federation(x, y, tuple(np.arange(a, b) for a, b in zip(bounds[:-1], bounds[1:], strict=True)))
    apply = lambda p, xs: xs @ p  # noqa: E731
    loss = lambda p, key, xs, ys, mask: 0.5 * jnp.sum(mask * (apply(p, xs) - ys) ** 2) / jnp.maximum(jnp.sum(mask), 1.0)  # noqa: E731
    trainer = LocalTrainer(loss, optax.sgd(0.0), 1, 8)
    local = natural_full_vi(trainer, apply_fn=apply, task="regression", samples=2, steps=4, step_size=1.0)
    algo = pvi(trainer, optax.sgd(1.0), prior_precision=delta, damping=0.5, covariance="full", local=local)
    sim = Simulator(algo, fed, clients_per_round=len(sizes), seed=0)
    state = sim.init(jnp.zeros(DIM, jnp.float32))
    for _ in range(25):
        state, info = sim.run_round(state)
        assert len(info.rejected) == 0
    q = state.server_state.q
    prec = delta * np.eye(DIM) + x.T.astype(np.float64) @ x
    np.testing.assert_allclose(np.asarray(q.precision), prec, rtol=1e-4)
    np.testing.assert_allclose(np.asarray(gaussian_full.mean(q)), np.linalg.solve(prec, x.T @ y), rtol=1e-3, atol=1e-4)


def test_full_covariance_is_a_pvi_setting():
    full = validate({"algorithm": {"name": "pvi", "covariance": "full"}}).algorithm
    diagonal = validate({"algorithm": {"name": "pvi"}}).algorithm
    assert full.covariance == "full" and diagonal.covariance == "diagonal"
    # more draws per step by default for the dense client (its message's precision is biased by the noise)
    assert (default_samples(full), default_samples(diagonal), FULL_SAMPLES) == (8, 1, 8)
    assert default_samples(validate({"algorithm": {"name": "pvi", "covariance": "full", "samples": 2}}).algorithm) == 2
    # the natural-gradient client by default; a run stored before the setting existed keeps the Cholesky one
    assert full.full_vi == "natural"
    assert validate({"algorithm": {"name": "pvi", "covariance": "full", "full_vi": "cholesky"}}).algorithm.full_vi == "cholesky"
    from fedbayes.config.schema import stored_meaning

    old = {"algorithm": {"name": "pvi", "covariance": "full", "rho": "adaptive", "estimator": "local", "init_std": "auto", "init_mean": "auto"}}
    assert validate(stored_meaning(old)).algorithm.full_vi == "cholesky"
    assert validate(stored_meaning({"algorithm": {**old["algorithm"], "full_vi": "natural"}})).algorithm.full_vi == "natural"
    with pytest.raises(ConfigError, match="algorithm.full_vi: .*set covariance = 'full'"):
        validate({"algorithm": {"name": "pvi", "full_vi": "cholesky"}})
    assert validate({"algorithm": {"name": "pvi", "covariance": "full", "natural_steps": 8}}).algorithm.natural_steps == 8
    for algorithm in ({"name": "pvi", "natural_steps": 8}, {"name": "pvi", "covariance": "full", "full_vi": "cholesky", "natural_steps": 8}):
        with pytest.raises(ConfigError, match="algorithm.natural_steps: .*needs covariance = 'full' and full_vi = 'natural'"):
            validate({"algorithm": algorithm})
    for extra, field in (
        ({"server": {"aggregator": "median"}}, "server.aggregator: pvi with covariance = 'full'"),
        ({"privacy": {"clip": 1.0}, "server": {"weighting": "uniform"}}, "privacy.clip: pvi with covariance = 'full'"),
    ):
        with pytest.raises(ConfigError, match=field) as err:
            validate({"algorithm": {"name": "pvi", "covariance": "full"}, **extra})
        assert "\n" not in str(err.value)
