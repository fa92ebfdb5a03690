"""FedLap-Cov (docs/algorithms.md §10): its update functions on numbers worked by hand, and the
method on least-squares clients with exact local solves (``least_squares.py``), where the target,
the MAP of ``sum_k l_k(w) + delta/2 ||w||^2``, is known in closed form."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from least_squares import BATCH, DIM, SIZES, Problem, flat_params, newton_solver, run_rounds

from fedbayes import gaussian, protocol
from fedbayes.algorithms import damping as damping_policy
from fedbayes.algorithms.fedlap import fedlap
from fedbayes.algorithms.fedlap_cov import (
    DIAGONAL,
    Broadcast,
    FedLapCovInfo,
    PrecisionOps,
    fedlap_cov,
    server_init,
    site_terms,
    site_update,
)
from fedbayes.algorithms.fedlap_cov import broadcast as cov_broadcast
from fedbayes.algorithms.fedlap_cov import client_step as cov_client_step
from fedbayes.algorithms.fedlap_cov import server_init as cov_server_init
from fedbayes.algorithms.fedlap_cov import server_step as cov_server_step
from fedbayes.algorithms.sites import GaussianMessage
from fedbayes.data.batches import get_batch
from fedbayes.gaussian import DiagGaussian
from fedbayes.inference.curvature import data_curvature
from fedbayes.inference.sgd import LocalTrainer

# ----- the update functions, by hand ----------------------------------------------------------------


def _message(anchor, precision, damping=0.5):
    return Broadcast(anchor=jnp.asarray(anchor), precision=jnp.asarray(precision), start=jnp.asarray(anchor), damping=damping)


def test_site_update_is_the_damped_move_to_the_local_laplace_site():
    """``S_k = H + S_g - V``; target ``(v + S_k w_k - S_g w_g, H)``; the site moves ``rho`` of the way.
    Two coordinates: v = (1, 0), V = (2, 0), S_g = (5, 1), w_g = (0.5, 2), H = (3, 4), w_k = (1.5, 1),
    rho = 0.5: S_k = (6, 5), change = (9 - 2.5, 5 - 2) = (6.5, 3), target (7.5, 3; 3, 4),
    damped (4.25, 1.5; 2.5, 2)."""
    site = DiagGaussian(precision_mean=jnp.array([1.0, 0.0]), precision=jnp.array([2.0, 0.0]))
    new = site_update(site, jnp.array([1.5, 1.0]), _message([0.5, 2.0], [5.0, 1.0]), jnp.array([3.0, 4.0]), 0.5)
    np.testing.assert_array_equal(np.asarray(new.precision_mean), [4.25, 1.5])
    np.testing.assert_array_equal(np.asarray(new.precision), [2.5, 2.0])


def test_site_update_leaves_a_site_at_its_fixed_point_unchanged():
    """At ``w_k = w_g`` and ``V = H`` the target is the site itself, whatever ``rho``."""
    site = DiagGaussian(precision_mean=jnp.array([0.75, -2.0]), precision=jnp.array([3.0, 4.0]))
    message = _message([0.25, -1.0], [9.0, 6.0])
    for rho in (0.25, 1.0):
        new = site_update(site, message.anchor, message, site.precision, rho)
        np.testing.assert_array_equal(np.asarray(new.precision_mean), np.asarray(site.precision_mean))
        np.testing.assert_array_equal(np.asarray(new.precision), np.asarray(site.precision))


def test_site_terms_are_the_site_and_cavity_quadratics():
    """``v^T w - 1/2 w^T V w + 1/2 (w - w_g)^T S_g (w - w_g)`` at v = (1, 2), V = (2, 0), w = (1, 1),
    w_g = (0, 3), S_g = (4, 1): 3 - 1 + 0.5 (4 + 4) = 6."""
    site = DiagGaussian(precision_mean=jnp.array([1.0, 2.0]), precision=jnp.array([2.0, 0.0]))
    assert float(site_terms(jnp.array([1.0, 1.0]), _message([0.0, 3.0], [4.0, 1.0]), site)) == 6.0


def test_server_step_multiplies_the_changes_floors_at_delta_and_solves_for_the_mean():
    """``q_g`` times the changes: precisions (2 - 2.5, 3 + 1) = (-0.5, 4), the first floored at
    delta = 1; natural means (1 + 0.5, 2 + 0.5); ``w_g = (1.5 / 1, 2.5 / 4)``; the round counts one,
    and without a damping rule the damping's state is kept."""
    state = server_init(jnp.zeros(2), 1.0, damping=damping_policy.fixed(0.5))
    state = state._replace(q=DiagGaussian(precision_mean=jnp.array([1.0, 2.0]), precision=jnp.array([2.0, 3.0])))
    change = DiagGaussian(precision_mean=jnp.array([0.5, 0.5]), precision=jnp.array([-2.5, 1.0]))
    new = cov_server_step(state, change, 1.0)
    np.testing.assert_array_equal(np.asarray(new.q.precision), [1.0, 4.0])
    np.testing.assert_array_equal(np.asarray(new.q.precision_mean), [1.5, 2.5])
    np.testing.assert_array_equal(np.asarray(new.params), [1.5, 0.625])
    assert int(new.round) == 1 and new.damping is state.damping


def test_the_server_reports_the_damping_its_clients_used():
    alg = fedlap_cov(LocalTrainer(None, optax.sgd(0.1), 1, 1), lambda p, d: p, delta=2.0, damping=0.25)
    state = alg.server_init(jax.random.key(0), jnp.zeros(3))
    message = gaussian.uniform_like(jnp.zeros(3))
    aggregate = alg.aggregator(jax.random.key(0), jax.tree.map(lambda x: x[None], GaussianMessage(message, jnp.ones((), jnp.bool_))), jnp.ones(1))
    new, info = alg.server_update(jax.random.key(1), state, aggregate)
    assert isinstance(info, FedLapCovInfo) and float(info.damping) == 0.25
    np.testing.assert_array_equal(np.asarray(new.q.precision), 2.0)  # a zero change keeps S_g = delta


def test_diagonal_ops_act_coordinatewise():
    p, x = jnp.array([2.0, 4.0]), jnp.array([3.0, -1.0])
    np.testing.assert_array_equal(np.asarray(DIAGONAL.matvec(p, x)), [6.0, -4.0])
    np.testing.assert_array_equal(np.asarray(DIAGONAL.solve(p, x)), [1.5, -0.25])
    np.testing.assert_array_equal(np.asarray(DIAGONAL.at_least(jnp.array([0.5, 3.0]), 1.0)), [1.0, 3.0])


# ---------------------------------------------------------------------------------------------
# FedLap-Cov


def cov_algorithm(prob: Problem, *, delta, rho, curvature=None, init_precision="delta"):
    curvature = curvature or data_curvature(prob.apply_fn, task="regression", batch_size=BATCH)
    return fedlap_cov(prob.trainer, curvature, delta=delta, damping=rho, init_precision=init_precision, solver=newton_solver)


FULL = PrecisionOps(
    matvec=lambda p, x: p @ x,
    solve=lambda p, x: jnp.linalg.solve(p, x),
    scaled_identity=lambda params, c: c * jnp.eye(params.shape[0], dtype=params.dtype),
    at_least=lambda p, c: p,
)


def test_fedlap_cov_full_covariance_exact_hessians_undamped_is_the_map_in_one_round():
    # The same update functions with dense precisions over a flat parameter vector [kernel, bias].
    with jax.enable_x64(True):
        prob = Problem()

        def loss(p, key, x, y, m):
            r = x @ p[:DIM] + p[DIM] - y
            return jnp.sum(m * 0.5 * r**2) / jnp.maximum(jnp.sum(m), 1.0)

        trainer = prob.trainer._replace(loss_fn=loss)

        def hessian(p, data):  # exact Hessian of the sum loss
            x, y, m = get_batch(data, jnp.zeros((), jnp.int32), BATCH)
            return jax.hessian(lambda q: loss(q, None, x, y, m) * jnp.sum(m))(p)

        delta, rho = 1.3, 1.0
        params = jnp.asarray(np.random.default_rng(5).normal(size=DIM + 1))
        state = cov_server_init(params, delta, FULL)
        client = jax.jit(
            lambda m, site, data: cov_client_step(jax.random.key(0), m, site, data, trainer, damping=rho, curvature=hessian, ops=FULL, solver=newton_solver)[2]
        )
        sites = [DiagGaussian(precision_mean=jnp.zeros(DIM + 1), precision=jnp.zeros((DIM + 1, DIM + 1))) for _ in prob.datas]
        for r in range(2):
            message = cov_broadcast(state)
            new_sites = [client(message, site, data) for site, data in zip(sites, prob.datas)]
            total = jax.tree.map(lambda *xs: sum(xs), *[gaussian.difference(n, o) for n, o in zip(new_sites, sites)])
            state, sites = cov_server_step(state, total, delta, FULL), new_sites
            np.testing.assert_allclose(np.asarray(state.params), prob.map(delta), rtol=1e-9, atol=1e-11)  # round 1, and it stays
            np.testing.assert_allclose(np.asarray(state.q.precision), sum(prob.hessians()) + delta * np.eye(DIM + 1), rtol=1e-12)


def test_data_curvature_is_the_exact_diagonal_over_all_minibatches():
    with jax.enable_x64(True):
        prob = Problem()
        for batch_size in (4, BATCH):  # 2-3 minibatches, then one
            curv = data_curvature(prob.apply_fn, task="regression", batch_size=batch_size)
            for data, h in zip(prob.datas, prob.hessians()):
                np.testing.assert_allclose(flat_params(curv(prob.params, data)), np.diag(h), rtol=1e-10)


@pytest.mark.parametrize("rho", [1.0, 0.25])
def test_fedlap_cov_diagonal_ggn_converges_to_the_exact_map_with_valid_precisions(rho):
    delta = 7.0
    with jax.enable_x64(True):
        prob = Problem()
        alg = cov_algorithm(prob, delta=delta, rho=rho)

        def invariants(state, cstates):
            for leaf in jax.tree.leaves(state.q.precision):
                assert np.all(np.asarray(leaf) >= delta)
            for cs in cstates:
                for leaf in jax.tree.leaves(cs.precision):
                    assert np.all(np.asarray(leaf) >= 0)

        state, cstates, history = run_rounds(alg, prob, 80, on_round=invariants)
        target = prob.map(delta)
        assert np.max(np.abs(history[-1] - target)) < 1e-8
        # S_g = delta + sum_k V_k, and at the fixed point V_k = diag(H_k).
        np.testing.assert_allclose(flat_params(state.q.precision), delta + sum(np.diag(h) for h in prob.hessians()), rtol=1e-8)
        mean, var = alg.server_posterior(state)
        np.testing.assert_allclose(flat_params(var), 1.0 / flat_params(state.q.precision))
        np.testing.assert_array_equal(flat_params(mean), history[-1])


def test_fedlap_cov_gets_closer_than_fedlap_in_the_same_rounds():
    # The preconditioning is the point of the method (about 25 times closer here after 10 rounds).
    delta = 7.0
    with jax.enable_x64(True):
        prob = Problem()
        target = prob.map(delta)
        _, _, lap = run_rounds(fedlap(prob.trainer, delta=delta, damping=0.5, solver=newton_solver), prob, 10)
        _, _, cov = run_rounds(cov_algorithm(prob, delta=delta, rho=0.5), prob, 10)
        assert np.max(np.abs(cov[-1] - target)) < 0.1 * np.max(np.abs(lap[-1] - target))


def test_fedlap_cov_with_zero_curvature_is_fedlap():
    # H = 0: V_k = 0, S_g = delta, and v_cov = delta v_lap (docs/algorithms.md §9, §10).
    delta, rho = 3.0, 0.25
    with jax.enable_x64(True):
        prob = Problem()
        zero = lambda p, data: jax.tree.map(jnp.zeros_like, p)  # noqa: E731
        lap_state, lap_sites, lap = run_rounds(fedlap(prob.trainer, delta=delta, damping=rho, solver=newton_solver), prob, 6)
        cov_state, cov_sites, cov = run_rounds(cov_algorithm(prob, delta=delta, rho=rho, curvature=zero), prob, 6)
        for a, b in zip(lap, cov):
            np.testing.assert_allclose(b, a, rtol=1e-10, atol=1e-12)
        for ls, cs in zip(lap_sites, cov_sites):
            np.testing.assert_allclose(flat_params(cs.precision_mean), delta * flat_params(ls), rtol=1e-10, atol=1e-12)
            np.testing.assert_array_equal(flat_params(cs.precision), 0.0)
        np.testing.assert_array_equal(flat_params(cov_state.q.precision), delta)


def test_fedlap_cov_zero_initial_precision_is_the_reference_round_one():
    # Round 1 with S_g = 0: no prox term (local least squares), V_k = rho H_k, v_k = rho H_k w_k.
    delta, rho = 2.0, 0.5
    with jax.enable_x64(True):
        prob = Problem()
        alg = cov_algorithm(prob, delta=delta, rho=rho, init_precision="zero")
        state = alg.server_init(jax.random.key(0), prob.params)
        np.testing.assert_array_equal(flat_params(alg.broadcast(state).precision), 0.0)
        state, _, history = run_rounds(alg, prob, 1)
        local = [np.linalg.solve(h, z.T @ y) for h, z, y in zip(prob.hessians(), prob.z, prob.y)]
        hd = [np.diag(h) for h in prob.hessians()]
        s_g = delta + rho * sum(hd)
        np.testing.assert_allclose(history[0], rho * sum(d * w for d, w in zip(hd, local)) / s_g, rtol=1e-9)
        np.testing.assert_allclose(flat_params(alg.broadcast(state).precision), s_g, rtol=1e-12)
        # and the default sends delta in round 1
        default = cov_algorithm(prob, delta=delta, rho=rho)
        np.testing.assert_array_equal(flat_params(default.broadcast(default.server_init(jax.random.key(0), prob.params)).precision), delta)


def test_fedlap_cov_rejects_a_negative_curvature_and_keeps_the_server():
    with jax.enable_x64(True):
        prob = Problem()
        bad = lambda p, data: jax.tree.map(lambda x: -jnp.ones_like(x), p)  # noqa: E731
        alg = cov_algorithm(prob, delta=1.0, rho=0.5, curvature=bad)
        state = alg.server_init(jax.random.key(0), prob.params)
        message = alg.broadcast(state)
        update = jax.jit(alg.client_update)
        msgs = [update(jax.random.key(0), message, alg.client_init(prob.params), d)[0] for d in prob.datas]
        stacked = jax.tree.map(lambda *xs: jnp.stack(xs), *msgs)
        new, accepted, _ = protocol.server_step(jax.random.key(1), alg, state, stacked, jnp.ones(len(SIZES)))
        assert not np.any(np.asarray(accepted))
        np.testing.assert_array_equal(flat_params(new.q.precision), flat_params(state.q.precision))


def test_fedlap_cov_settings_are_checked():
    with pytest.raises(ValueError, match="fedlap_cov: init_precision must be one of delta, zero"):
        fedlap_cov(LocalTrainer(None, optax.sgd(0.1), 1, 1), lambda p, d: p, delta=1.0, damping=0.5, init_precision="one")
    with pytest.raises(ValueError, match="fedlap_cov: rho"):
        fedlap_cov(LocalTrainer(None, optax.sgd(0.1), 1, 1), lambda p, d: p, delta=1.0, damping=2.0)


@pytest.mark.parametrize("dense", [False, True])
def test_the_local_step_is_stable_under_a_stiff_cavity_and_reaches_the_exact_local_optimum(dense, monkeypatch):
    """A client of 5 examples under a cavity of precision 1000 in one coordinate (diagonal) or with a
    common direction of eigenvalue 450 (dense, correlated): plain SGD at lr 1 has ``lr S / n >> 2`` and
    blows up (the control off: STEP_CAP = 0); with the control (the default) 500 steps reach the
    exact minimiser of the same objective (one Newton step on the quadratic)."""
    from fedbayes.algorithms import fedlap_cov as module
    from fedbayes.algorithms.fedlap_cov import DENSE

    with jax.enable_x64(True):
        prob = Problem()
        data = prob.datas[2]
        trainer = prob.trainer._replace(optimizer=optax.sgd(1.0), num_epochs=500)
        flat, unravel = jax.flatten_util.ravel_pytree(prob.params)
        if dense:
            ops, precision = DENSE, 100.0 * jnp.ones((flat.size, flat.size)) + 50.0 * jnp.eye(flat.size)
        else:
            ops, precision = DIAGONAL, unravel(jnp.asarray([1000.0, 1.0, 1.0, 1.0]))
        site = ops.family.uniform_like(prob.params)
        message = Broadcast(anchor=prob.params, precision=precision, start=prob.params, damping=1.0)
        curvature = lambda w, d: site.precision  # noqa: E731  (the curvature does not enter the local solve)
        args = dict(damping=1.0, curvature=curvature, ops=ops)
        exact, _, _, _ = cov_client_step(jax.random.key(0), message, site, data, trainer, solver=newton_solver, **args)
        controlled, _, _, _ = cov_client_step(jax.random.key(0), message, site, data, trainer, **args)
        np.testing.assert_allclose(flat_params(controlled), flat_params(exact), rtol=1e-4, atol=1e-6)
        monkeypatch.setattr(module, "STEP_CAP", 0.0)
        plain, _, _, _ = cov_client_step(jax.random.key(0), message, site, data, trainer, **args)
        w = flat_params(plain)
        assert not np.all(np.isfinite(w)) or np.max(np.abs(w)) > 1e6
