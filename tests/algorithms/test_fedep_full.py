"""FedEP with full-covariance (dense precision) sites: with the laplace method the fixed point is the
central full Laplace, with the ngvi method the central full-covariance VI optimum."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.flatten_util import ravel_pytree

from fedbayes import gaussian_full
from fedbayes.algorithms.fedep import fedep_full
from fedbayes.config.schema import ConfigError, validate
from fedbayes.data.federation import Federation
from fedbayes.evaluation.reference import full_covariance_vi as central_full_vi
from fedbayes.inference import LocalTrainer
from fedbayes.inference.curvature import batch_full_ggn, diag_ggn
from fedbayes.inference.tilted import TiltedSettings, make_full_laplace_inference, make_full_ngvi_inference
from fedbayes.models import init_params, loss_fn, make_model
from fedbayes.runs.export import save_model
from fedbayes.sim.simulator import Simulator

NUM_CLIENTS, PER_CLIENT, FEATURES, CLASSES = 3, 50, 5, 2
PRIOR = 1.0


def _problem(seed=0):
    """A logistic regression: 3 clients of 50 examples, 5 features, each client's features shifted."""
    rng = np.random.default_rng(seed)
    w = rng.normal(size=(FEATURES,))
    xs, ys = [], []
    for k in range(NUM_CLIENTS):
        x = rng.normal(size=(PER_CLIENT, FEATURES)) + 0.5 * k
        y = (rng.random(PER_CLIENT) < 1.0 / (1.0 + np.exp(-(x @ w - 0.5 * k)))).astype(np.int32)
        xs.append(x)
        ys.append(y)
    x = np.concatenate(xs).astype(np.float32)
    y = np.concatenate(ys)
    parts = tuple(np.arange(k * PER_CLIENT, (k + 1) * PER_CLIENT) for k in range(NUM_CLIENTS))
    model = make_model("logreg", CLASSES)
    params = init_params(model, jax.random.key(0), (FEATURES,))
    return Federation(x, y, parts), model, params


def _central_laplace(model, params, x, y):
    """MAP of all data with the prior N(0, 1 / PRIOR) by Newton's method in float64, and the
    precision there: the full Hessian of the negative log joint (= GGN + prior for a GLM)."""
    with jax.enable_x64(True):
        flat0, unravel = ravel_pytree(jax.tree.map(lambda a: jnp.asarray(a, jnp.float64), params))
        xd, yd = jnp.asarray(x, jnp.float64), jnp.asarray(y)

        def nlj(theta):
            logits = model.apply({"params": unravel(theta)}, xd)
            nll = -jnp.sum(jnp.take_along_axis(jax.nn.log_softmax(logits), yd[:, None], axis=1))
            return nll + 0.5 * PRIOR * theta @ theta

        theta = jnp.zeros_like(flat0)
        for _ in range(50):
            theta = theta - jnp.linalg.solve(jax.hessian(nlj)(theta), jax.grad(nlj)(theta))
        return np.asarray(theta), np.asarray(jax.hessian(nlj)(theta))


def _run(rounds, damping=0.5, method="laplace", **kw):
    fed, model, params = _problem()
    trainer = LocalTrainer(loss_fn(model, "classification"), optax.sgd(0.5), 50, PER_CLIENT)
    make = make_full_laplace_inference if method == "laplace" else make_full_ngvi_inference
    inference = make(trainer, TiltedSettings(), apply_fn=lambda p, x: model.apply({"params": p}, x))
    algo = fedep_full(
        trainer, optax.sgd(1.0), inference, total_examples=NUM_CLIENTS * PER_CLIENT, num_clients=NUM_CLIENTS, damping=damping, alpha_cov=0.0,
        prior_precision=PRIOR, exact_late_sites=True, **kw,
    )  # fmt: skip
    sim = Simulator(algo, fed, clients_per_round=NUM_CLIENTS, seed=0)
    state = sim.init(params)
    for _ in range(rounds):
        state, info = sim.run_round(state)
        assert len(info.rejected) == 0
    return fed, model, params, algo, state


def test_the_fixed_point_is_the_central_full_laplace(tmp_path):
    fed, model, params, algo, state = _run(30)
    map_flat, hessian = _central_laplace(model, params, fed.x, fed.y)
    mean, variance = algo.server_posterior(state.server_state)
    q = state.server_state.q
    np.testing.assert_allclose(ravel_pytree(mean)[0], map_flat, atol=1e-4)  # float32 clients (reached to about 1e-5 within 20 rounds)
    cov = np.linalg.inv(hessian)
    np.testing.assert_allclose(np.asarray(gaussian_full.covariance(q)), cov, rtol=1e-3, atol=1e-4 * np.max(np.abs(cov)))  # float32
    np.testing.assert_allclose(ravel_pytree(variance)[0], np.diag(cov), rtol=1e-3)  # float32
    # model.npz: the mean, the marginal variances and the dense precision
    with np.load(save_model(tmp_path / "model.npz", algo, state.server_state)) as z:
        np.testing.assert_array_equal(z["posterior_precision"], np.asarray(q.precision))
        np.testing.assert_array_equal(z["posterior_variance/dense/kernel"], np.asarray(variance["dense"]["kernel"]))


def test_the_ngvi_fixed_point_is_the_central_full_covariance_vi():
    # damped 0.2: the sites' draw noise averages over about ten rounds
    fed, model, params, algo, state = _run(40, damping=0.2, method="ngvi")
    mean, cov = central_full_vi(lambda p, x: model.apply({"params": p}, x), params, fed.x, fed.y, PRIOR)
    q = state.server_state.q
    err = ravel_pytree(gaussian_full.mean(q))[0] - ravel_pytree(mean)[0]
    assert np.linalg.norm(err) < 0.01 * np.linalg.norm(ravel_pytree(mean)[0])
    np.testing.assert_allclose(np.asarray(gaussian_full.covariance(q)), cov, atol=0.005 * np.max(np.abs(cov)))
    # the VI optimum's mean is not the MAP (the Laplace family's): the test tells them apart
    map_flat, _ = _central_laplace(model, params, fed.x, fed.y)
    assert np.linalg.norm(map_flat - ravel_pytree(mean)[0]) > 3 * np.linalg.norm(err)


def test_the_dense_ggn_has_the_diagonal_ggn_on_its_diagonal():
    fed, model, params = _problem()
    apply = lambda p, x: model.apply({"params": p}, x)  # noqa: E731
    params = jax.tree.map(lambda a: a + 0.3, params)
    x = jnp.asarray(fed.x[:40])
    mask = jnp.ones((40,), jnp.float32).at[-5:].set(0.0)
    full = batch_full_ggn(apply, params, x, mask)
    diag = ravel_pytree(diag_ggn(apply, params, x[:35]))[0]
    np.testing.assert_allclose(np.diag(full), diag, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(full, full.T, atol=1e-5)


def test_full_covariance_is_a_fedep_laplace_setting():
    cfg = validate({"algorithm": {"name": "fedep", "covariance": "full"}})
    assert cfg.algorithm.covariance == "full" and cfg.evaluation.prior_precision == "fixed"
    assert validate({"algorithm": {"name": "fedep"}}).algorithm.covariance == "diagonal"
    assert validate({"algorithm": {"name": "fedsep", "covariance": "full", "method": "ngvi"}}).algorithm.covariance == "full"
    for algorithm, field in (
        ({"name": "fedep", "covariance": "full", "method": "identity"}, "algorithm.covariance: 'full' takes the laplace method"),
        ({"name": "fedep", "covariance": "full", "method": "mcmc"}, "algorithm.covariance: 'full' takes the laplace method"),
        ({"name": "fedep", "covariance": "full", "method": "ngvi", "ngvi_beta": 0.9}, "algorithm.ngvi_beta: the ngvi method with covariance = 'full'"),
        ({"name": "fedep", "covariance": "full", "method": "ngvi", "scale": 2.0}, "algorithm.scale: the ngvi method with covariance = 'full'"),
        ({"name": "fedep", "covariance": "full", "natural_steps": 8}, "algorithm.natural_steps: sets the iterations of the ngvi method"),
        ({"name": "fedsep", "method": "ngvi", "natural_steps": 8}, "algorithm.natural_steps: sets the iterations of the ngvi method"),
        ({"name": "fedep", "covariance": "full", "burn_in_rounds": 2}, "algorithm.covariance: 'full' runs EP from the first round"),
        ({"name": "fedsep", "covariance": "full"}, "algorithm.method: fedsep with covariance = 'full' takes the ngvi or nuts method"),
    ):
        with pytest.raises(ConfigError, match=field) as err:
            validate({"algorithm": algorithm})
        assert "\n" not in str(err.value)
    for extra, field in (
        ({"server": {"aggregator": "median"}}, "server.aggregator: fedep with covariance = 'full'"),
        ({"server": {"max_precision_share": 0.5}}, "server.max_precision_share: fedep with covariance = 'full'"),
        ({"privacy": {"clip": 1.0}, "server": {"weighting": "uniform"}}, "privacy.clip: fedep with covariance = 'full'"),
    ):
        with pytest.raises(ConfigError, match=field):
            validate({"algorithm": {"name": "fedep", "covariance": "full"}, **extra})
