"""FedLap-Cov with the low-rank structure in a shared basis: on least-squares clients with exact
local solves the server reaches the MAP and the structured precision ``delta I + diag((I - P) H (I - P))
+ P H P`` of its basis, and the basis rounds find the leading eigenspace of ``H``; on a logistic
regression and a small network with SGD clients the fixed point is the central Laplace in that
structure; model.npz, the personalised posterior, the predictive's draws, and the config's refusals."""

from __future__ import annotations

import jax
import numpy as np
import optax
import pytest
from jax.flatten_util import ravel_pytree
from least_squares import DIM, Problem, newton_solver, run_rounds

from fedbayes import gaussian_lowrank, gaussian_subspace
from fedbayes.algorithms import damping as damping_policy
from fedbayes.algorithms import sites
from fedbayes.algorithms.fedlap_cov import fedlap_cov
from fedbayes.config.schema import ConfigError, validate
from fedbayes.inference.curvature import data_subspace_ggn
from fedbayes.runs.export import load_model, save_model

# ravel order of the linear model's {"dense": {"bias", "kernel"}} against least_squares' [kernel, bias]
PERM = [DIM, *range(DIM)]


def _algorithm(apply_fn, trainer, *, task, rho, rank, basis_rounds, solver=None, delta=1.0):
    def curvature(params, data, basis):
        return data_subspace_ggn(apply_fn, params, data, basis, batch_size=trainer.batch_size, task=task)

    kw = {"solver": solver} if solver is not None else {}
    return fedlap_cov(trainer, curvature, delta=delta, damping=rho, covariance="low_rank", rank=rank, basis_rounds=basis_rounds, **kw)


def _structured(h: np.ndarray, basis: np.ndarray, delta: float) -> np.ndarray:
    """``delta I + diag((I - P) H (I - P)) + P H P``, ``P = B B^T``."""
    p = basis @ basis.T
    rest = (np.eye(len(h)) - p) @ h @ (np.eye(len(h)) - p)
    return delta * np.eye(len(h)) + np.diag(np.diag(rest)) + p @ h @ p


def _projector(basis) -> np.ndarray:
    b = np.asarray(basis)
    return b @ b.T


def test_least_squares_reach_the_map_and_the_structured_precision(tmp_path):
    delta = 1.3
    with jax.enable_x64(True):
        prob = Problem()
        alg = _algorithm(prob.apply_fn, prob.trainer, task="regression", rho=1.0, rank=2, basis_rounds=2, solver=newton_solver, delta=delta)
        state, cstates, history = run_rounds(alg, prob, 40)
        family = gaussian_subspace.in_basis(state.basis)
        h = sum(prob.hessians())[np.ix_(PERM, PERM)]
        want = _structured(h, np.asarray(state.basis), delta)
        np.testing.assert_allclose(np.asarray(family.precision_matrix(state.q.precision)), want, rtol=1e-9, atol=1e-10)
        # the MAP: the fixed point does not depend on the structure
        np.testing.assert_allclose(history[-1], prob.map(delta), rtol=1e-8, atol=1e-10)
        assert np.abs(np.asarray(cstates[0].precision.core)).max() > 0  # the sites carry cores once the basis is fixed
        # the marginal variances
        _, variance = alg.server_posterior(state)
        np.testing.assert_allclose(ravel_pytree(variance)[0], np.diag(np.linalg.inv(want)), rtol=1e-9)
        # model.npz: the precision as diag(d) + U diag(s) U^T, read back as that structure
        path = save_model(tmp_path / "model.npz", alg, state)
        with np.load(path) as z:
            assert z["posterior_precision_factors"].shape == (DIM + 1, 2) and "posterior_precision" not in z.files
        saved = load_model(path)["posterior_precision"]
        np.testing.assert_allclose(np.asarray(gaussian_lowrank.precision_matrix(saved)), want, rtol=1e-9, atol=1e-10)
        # the personalised posterior q_g t_k^w in the same structure
        mean_k, var_k = alg.personal_posterior(state, cstates[1], 0.5)
        site = np.asarray(family.precision_matrix(cstates[1].precision))
        eta = ravel_pytree(state.q.precision_mean)[0] + 0.5 * ravel_pytree(cstates[1].precision_mean)[0]
        lam = want + 0.5 * site
        np.testing.assert_allclose(ravel_pytree(mean_k)[0], np.linalg.solve(lam, eta), rtol=1e-8)
        np.testing.assert_allclose(ravel_pytree(var_k)[0], np.diag(np.linalg.inv(lam)), rtol=1e-8)


def test_the_basis_rounds_find_the_leading_eigenspace():
    with jax.enable_x64(True):
        prob = Problem()
        h = sum(prob.hessians())[np.ix_(PERM, PERM)]
        top = np.linalg.eigh(h)[1][:, -2:]
        alg = _algorithm(prob.apply_fn, prob.trainer, task="regression", rho=1.0, rank=2, basis_rounds=40, solver=newton_solver)
        state, _, _ = run_rounds(alg, prob, 40)
        np.testing.assert_allclose(_projector(state.basis), top @ top.T, atol=1e-8)
        # a random basis is not it: the test can fail
        start = alg.server_init(jax.random.key(0), prob.params)
        assert np.abs(_projector(start.basis) - top @ top.T).max() > 0.05


def test_logistic_clients_reach_the_central_laplace_in_the_structure():
    from test_fedep_full import PER_CLIENT, _central_laplace, _problem
    from test_fedlap_cov_last_layer import _run

    from fedbayes.inference import LocalTrainer
    from fedbayes.models import loss_fn

    fed, model, params = _problem()
    apply = lambda p, x: model.apply({"params": p}, x)  # noqa: E731
    trainer = LocalTrainer(loss_fn(model, "classification"), optax.sgd(0.2), 200, PER_CLIENT)
    alg = _algorithm(apply, trainer, task="classification", rho=damping_policy.adaptive(), rank=4, basis_rounds=3)
    server = _run(alg, fed, params, 30)  # every round's messages accepted
    map_flat, hessian = _central_laplace(model, params, fed.x, fed.y)
    np.testing.assert_allclose(ravel_pytree(alg.server_params(server))[0], map_flat, atol=1e-3)
    lam = np.asarray(gaussian_subspace.in_basis(server.basis).precision_matrix(server.q.precision))
    want = _structured(hessian - np.eye(len(hessian)), np.asarray(server.basis), 1.0)  # the Hessian holds the prior's delta = 1
    np.testing.assert_allclose(lam, want, rtol=2e-2, atol=2e-3 * np.abs(want).max())  # float32 clients
    # the predictive draws from the structure itself: the spread's precision is q_g's
    from fedbayes.evaluation.evaluators import dense_spread, restrict_to_subset

    spread = dense_spread(server.params, alg.server_precision(server))
    np.testing.assert_allclose(np.asarray(gaussian_lowrank.precision_matrix(spread)), lam, rtol=1e-5, atol=1e-5 * np.abs(lam).max())
    assert not np.any(ravel_pytree(spread.precision_mean)[0])
    # the last layer's marginal: the joint's draws with the other layers at the mean
    assert restrict_to_subset(spread, "last_layer").key == "dense"
    # three power steps from a random start: the basis holds the curvature's leading direction
    # (eigenvalue 204 against 63 next; the GGN has 6 nonzero eigenvalues here, the rank is 4)
    top = np.linalg.eigh(hessian)[1][:, -1:]
    assert np.linalg.norm(top - _projector(server.basis) @ top) < 0.1
    # closer to the full Laplace's marginal variances than the diagonal structure at the same point
    full = np.diag(np.linalg.inv(hessian))
    low_rank = np.diag(np.linalg.inv(lam)) / full
    diagonal = (1.0 / np.diag(hessian)) / full
    assert np.median(low_rank) > 2 * np.median(diagonal) and low_rank.min() > 2 * diagonal.min()


def test_message_holds_the_sketch_and_its_size_is_counted():
    with jax.enable_x64(True):
        prob = Problem()
        alg = _algorithm(prob.apply_fn, prob.trainer, task="regression", rho=1.0, rank=2, basis_rounds=1, solver=newton_solver)
        state = alg.server_init(jax.random.key(0), prob.params)
        message, _, _ = jax.jit(alg.client_update)(jax.random.key(1), alg.broadcast(state), alg.client_init(prob.params), prob.datas[0])
        d = DIM + 1
        assert message.sketch.shape == (d, 2)
        numbers = sum(np.size(x) for x in jax.tree.leaves(message.difference)) + message.sketch.size
        assert numbers * sites.FLOAT32_BYTES == sites.natural_bytes(d, "low_rank", 2)
        # a non-finite sketch is refused like a non-finite difference
        assert bool(alg.message_ok(state, message))
        assert not bool(alg.message_ok(state, message._replace(sketch=message.sketch.at[0, 0].set(np.nan))))


def test_low_rank_is_a_fedlap_cov_setting():
    cfg = validate({"algorithm": {"name": "fedlap_cov", "covariance": "low_rank", "rank": 3}})
    assert cfg.algorithm.rank == 3 and cfg.algorithm.basis_rounds == 3
    # the prior precision re-chosen on the structure itself, the last layer's marginal drawn
    assert cfg.evaluation.prior_precision == "marglik" and cfg.evaluation.subset_of_weights == "last_layer"
    for extra, field in (
        ({"server": {"aggregator": "median"}}, "server.aggregator: fedlap_cov with covariance = 'low_rank'"),
        ({"privacy": {"clip": 1.0}, "server": {"weighting": "uniform"}}, "privacy.clip: fedlap_cov with covariance = 'low_rank'"),
    ):
        with pytest.raises(ConfigError, match=field) as err:
            validate({"algorithm": {"name": "fedlap_cov", "covariance": "low_rank"}, **extra})
        assert "\n" not in str(err.value)
    with pytest.raises(ConfigError, match="algorithm.rank"):
        validate({"algorithm": {"name": "fedlap_cov", "covariance": "low_rank", "rank": 0}})
    with pytest.raises(ValueError, match="algorithm.rank: must be below the model's 12 parameters") as err:
        sites.check_low_rank_size(12, 12)
    assert "\n" not in str(err.value)
    with pytest.raises(ValueError, match="algorithm.rank: a rank-200 message") as err:
        sites.check_low_rank_size(200, 200_000)
    sites.check_low_rank_size(10, 199_210)  # the main job's MLP at the default rank
