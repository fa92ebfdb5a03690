"""FedLap-Cov with full-covariance (dense GGN) sites: on least-squares clients with exact local
solves the server reaches the MAP and the exact dense posterior precision; on a logistic regression
with SGD clients the fixed point is the central full Laplace; the config and its refusals."""

from __future__ import annotations

import jax
import numpy as np
import optax
import pytest
from jax.flatten_util import ravel_pytree
from least_squares import DIM, Problem, flat_params, newton_solver, run_rounds

from fedbayes import gaussian_full
from fedbayes.algorithms import damping as damping_policy
from fedbayes.algorithms.fedlap_cov import fedlap_cov
from fedbayes.config.schema import ConfigError, validate
from fedbayes.inference.curvature import data_full_ggn
from fedbayes.runs.export import save_model

# ravel order of the linear model's {"dense": {"bias", "kernel"}} against least_squares' [kernel, bias]
PERM = [DIM, *range(DIM)]


def _dense_algorithm(prob: Problem, *, delta, rho):
    def curvature(params, data):
        return data_full_ggn(prob.apply_fn, params, data, batch_size=prob.trainer.batch_size, task="regression")

    return fedlap_cov(prob.trainer, curvature, delta=delta, damping=rho, solver=newton_solver, covariance="full")


def _target_precision(prob: Problem, delta):
    a = sum(prob.hessians()) + delta * np.eye(DIM + 1)
    return a[np.ix_(PERM, PERM)]


@pytest.mark.parametrize("rho,rounds", [(1.0, 2), ("adaptive", 60)])
def test_least_squares_reach_the_map_and_the_exact_dense_precision(rho, rounds, tmp_path):
    delta = 1.3
    with jax.enable_x64(True):
        prob = Problem()
        damping = damping_policy.adaptive() if rho == "adaptive" else rho
        alg = _dense_algorithm(prob, delta=delta, rho=damping)
        state, cstates, history = run_rounds(alg, prob, rounds)
        # undamped: the MAP and the full posterior precision after one round (a quadratic: GGN = Hessian)
        np.testing.assert_allclose(history[-1], prob.map(delta), rtol=1e-7, atol=1e-9)
        np.testing.assert_allclose(np.asarray(state.q.precision), _target_precision(prob, delta), rtol=1e-7, atol=1e-9)
        assert np.abs(np.asarray(cstates[0].precision) - np.diag(np.diag(np.asarray(cstates[0].precision)))).max() > 0  # the sites are dense
        mean, variance = alg.server_posterior(state)
        np.testing.assert_allclose(flat_params(variance), np.diag(np.linalg.inv(_target_precision(prob, delta)))[np.argsort(PERM)], rtol=1e-7)
        with np.load(save_model(tmp_path / "model.npz", alg, state)) as z:
            np.testing.assert_array_equal(z["posterior_precision"], np.asarray(state.q.precision))


def test_logistic_clients_reach_the_central_full_laplace():
    from test_fedep_full import NUM_CLIENTS, PER_CLIENT, _central_laplace, _problem

    from fedbayes.inference import LocalTrainer
    from fedbayes.models import loss_fn
    from fedbayes.sim.simulator import Simulator

    fed, model, params = _problem()
    apply = lambda p, x: model.apply({"params": p}, x)  # noqa: E731
    trainer = LocalTrainer(loss_fn(model, "classification"), optax.sgd(0.2), 200, PER_CLIENT)
    alg = fedlap_cov(trainer, lambda p, d: data_full_ggn(apply, p, d, batch_size=PER_CLIENT), delta=1.0, damping=damping_policy.adaptive(), covariance="full")
    sim = Simulator(alg, fed, clients_per_round=NUM_CLIENTS, seed=0)
    state = sim.init(params)
    for _ in range(30):
        state, info = sim.run_round(state)
        assert len(info.rejected) == 0
    map_flat, hessian = _central_laplace(model, params, fed.x, fed.y)
    q = state.server_state.q
    np.testing.assert_allclose(ravel_pytree(alg.server_params(state.server_state))[0], map_flat, atol=1e-3)
    cov = np.linalg.inv(hessian)
    np.testing.assert_allclose(np.asarray(gaussian_full.covariance(q)), cov, rtol=1e-2, atol=1e-3 * np.max(np.abs(cov)))  # float32 clients


def test_full_covariance_is_a_fedlap_cov_setting():
    cfg = validate({"algorithm": {"name": "fedlap_cov", "covariance": "full"}})
    assert cfg.algorithm.covariance == "full" and cfg.evaluation.prior_precision == "fixed"
    with pytest.raises(ConfigError, match="evaluation.prior_precision"):
        validate({"algorithm": {"name": "fedlap_cov", "covariance": "full"}, "evaluation": {"prior_precision": "marglik"}})
    for extra, field in (
        ({"server": {"aggregator": "median"}}, "server.aggregator: fedlap_cov with covariance = 'full'"),
        ({"server": {"max_precision_share": 0.5}}, "server.max_precision_share: fedlap_cov with covariance = 'full'"),
        ({"privacy": {"clip": 1.0}, "server": {"weighting": "uniform"}}, "privacy.clip: fedlap_cov with covariance = 'full'"),
    ):
        with pytest.raises(ConfigError, match=field) as err:
            validate({"algorithm": {"name": "fedlap_cov", "covariance": "full"}, **extra})
        assert "\n" not in str(err.value)
