"""FedLap-Cov with the Kronecker-factored structure (EKFAC eigenbases): on least-squares clients with
exact local solves the server reaches the MAP and ``delta I`` plus the Hessian's layer blocks,
diagonal in the input factor's eigenbasis; the sites of clients absent when the bases are fixed are
projected when they return, so the server's product stays the product of the sites; on a logistic
regression with SGD clients the fixed point is the central Laplace in the structure, closer to the
full Laplace's marginal variances than the diagonal's; the message's size, and the config's
refusals."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.flatten_util import ravel_pytree
from least_squares import DIM, Problem, newton_solver, run_rounds

from fedbayes import gaussian_kron, protocol
from fedbayes.algorithms import damping as damping_policy
from fedbayes.algorithms import sites
from fedbayes.algorithms.fedlap_cov import fedlap_cov
from fedbayes.config.schema import ConfigError, validate
from fedbayes.inference.curvature import data_curvature, data_kron_ggn

# ravel order of the linear model's {"dense": {"bias", "kernel"}} against least_squares' [kernel, bias]
PERM = [DIM, *range(DIM)]


def _algorithm(apply_fn, trainer, *, task, rho, basis_rounds, solver=None, delta=1.0):
    def curvature(params, data, bases):
        return data_kron_ggn(apply_fn, params, data, bases, batch_size=trainer.batch_size, task=task)

    kw = {"solver": solver} if solver is not None else {}
    return fedlap_cov(trainer, curvature, delta=delta, damping=rho, covariance="kron", basis_rounds=basis_rounds, **kw)


def _layer_blocks(h: np.ndarray) -> np.ndarray:
    """``h`` (ravel order: bias, then the kernel) with the bias-kernel cross terms dropped."""
    out = h.copy()
    out[0, 1:] = out[1:, 0] = 0.0
    return out


def test_least_squares_reach_the_map_and_the_layer_blocks(tmp_path):
    delta = 1.3
    with jax.enable_x64(True):
        prob = Problem()
        alg = _algorithm(prob.apply_fn, prob.trainer, task="regression", rho=1.0, basis_rounds=2, solver=newton_solver, delta=delta)
        state, cstates, history = run_rounds(alg, prob, 30)
        h = sum(prob.hessians())[np.ix_(PERM, PERM)]
        # the kernel's input factor is sum_k X_k^T X_k, the kernel's Hessian block: its eigenbasis holds that block exactly
        lam = np.asarray(gaussian_kron.in_bases(state.basis.bases).precision_matrix(state.q.precision))
        np.testing.assert_allclose(lam, delta * np.eye(DIM + 1) + _layer_blocks(h), rtol=1e-9, atol=1e-10)
        np.testing.assert_allclose(history[-1], prob.map(delta), rtol=1e-8, atol=1e-10)
        # the basis rounds are the diagonal method, and fixing the bases re-expresses q_g about its mean: the
        # server's mean after round 2 is the diagonal method's
        curvature = data_curvature(prob.apply_fn, task="regression", batch_size=prob.trainer.batch_size)
        diagonal = fedlap_cov(prob.trainer, curvature, delta=delta, damping=1.0, solver=newton_solver)
        _, _, diagonal_history = run_rounds(diagonal, prob, 2)
        np.testing.assert_allclose(history[1], diagonal_history[1], rtol=1e-10, atol=1e-12)
        assert np.abs(history[2] - history[1]).max() > 1e-6  # and it moves on from there
        # the bases moved once, after round 2: the identity is not an eigenbasis of that block
        left = np.asarray(state.basis.bases["dense"]["kernel"].left)
        assert np.abs(np.abs(left) - np.eye(DIM)).max() > 0.1
        assert all(int(c.fixed) == 1 for c in cstates)
        _, variance = alg.server_posterior(state)
        np.testing.assert_allclose(ravel_pytree(variance)[0], np.diag(np.linalg.inv(lam)), rtol=1e-9)
        mean_k, var_k = alg.personal_posterior(state, cstates[1], 0.5)
        family = gaussian_kron.in_bases(state.basis.bases)
        lam_k = lam + 0.5 * np.asarray(family.precision_matrix(cstates[1].factor.precision))
        eta = ravel_pytree(state.q.precision_mean)[0] + 0.5 * ravel_pytree(cstates[1].factor.precision_mean)[0]
        np.testing.assert_allclose(ravel_pytree(mean_k)[0], np.linalg.solve(lam_k, eta), rtol=1e-8)
        np.testing.assert_allclose(ravel_pytree(var_k)[0], np.diag(np.linalg.inv(lam_k)), rtol=1e-8)


def _sum_of_sites(state, cstates, delta):
    """The prior times the sites, ``(sum_k v_k, delta + sum_k V_k)``, each site in the server's
    bases (a site from the basis rounds moved as its client will move it)."""
    total = gaussian_kron.KronGaussian(jax.tree.map(jnp.zeros_like, state.params), jax.tree.map(lambda p: jnp.full_like(p, delta), state.params))
    for c in cstates:
        site = c.factor if int(c.fixed) else gaussian_kron.move(c.factor, state.basis.bases, state.basis.anchor)
        total = gaussian_kron.product(total, site)
    return total


def test_absent_clients_sites_are_projected_when_they_return():
    delta = 0.7
    with jax.enable_x64(True):
        prob = Problem()
        alg = _algorithm(prob.apply_fn, prob.trainer, task="regression", rho=0.5, basis_rounds=2, solver=newton_solver, delta=delta)
        state = alg.server_init(jax.random.key(0), prob.params)
        cstates = [alg.client_init(prob.params) for _ in prob.datas]
        update = jax.jit(alg.client_update)
        step = jax.jit(lambda s, m, w: protocol.server_step(jax.random.key(2), alg, s, m, w))
        # rounds 1-2 (the basis rounds): everyone, then clients 0 and 1; then 0 and 1 for two rounds, then client 3 returns
        for r, cohort in enumerate(((0, 1, 2, 3), (0, 1), (0, 1), (0, 1), (3,))):
            message = alg.broadcast(state)
            outs = {k: update(jax.random.key(r), message, cstates[k], prob.datas[k]) for k in cohort}
            msgs = jax.tree.map(lambda *xs: jnp.stack(xs), *[o[0] for o in outs.values()])
            weights = jnp.asarray([float(prob.datas[k].num_examples) for k in cohort])
            state, accepted, _ = step(state, msgs, weights)
            assert bool(jnp.all(accepted))
            for k, o in outs.items():
                cstates[k] = o[1]
            total = _sum_of_sites(state, cstates, delta)
            np.testing.assert_allclose(ravel_pytree(state.q.precision)[0], ravel_pytree(total.precision)[0], rtol=1e-10)
            np.testing.assert_allclose(ravel_pytree(state.q.precision_mean)[0], ravel_pytree(total.precision_mean)[0], rtol=1e-9, atol=1e-12)
        assert [int(c.fixed) for c in cstates] == [1, 1, 0, 1]  # client 2 has not come back: its site waits in the identity bases
        # without the projection the server's product and the sites disagree: the test can fail
        raw = jax.tree.map(lambda p: jnp.full_like(p, delta), state.params)
        for c in cstates:
            raw = jax.tree.map(jnp.add, raw, c.factor.precision)
        assert np.abs(ravel_pytree(raw)[0] - ravel_pytree(state.q.precision)[0]).max() > 1e-3


def test_logistic_clients_reach_the_central_laplace_in_the_structure():
    from test_fedep_full import PER_CLIENT, _central_laplace, _problem
    from test_fedlap_cov_last_layer import _run

    from fedbayes.inference import LocalTrainer
    from fedbayes.models import loss_fn

    fed, model, params = _problem()
    apply = lambda p, x: model.apply({"params": p}, x)  # noqa: E731
    trainer = LocalTrainer(loss_fn(model, "classification"), optax.sgd(0.2), 200, PER_CLIENT)
    alg = _algorithm(apply, trainer, task="classification", rho=damping_policy.adaptive(), basis_rounds=3)
    server = _run(alg, fed, params, 30)
    map_flat, hessian = _central_laplace(model, params, fed.x, fed.y)
    np.testing.assert_allclose(ravel_pytree(alg.server_params(server))[0], map_flat, atol=1e-3)
    u = np.asarray(gaussian_kron.dense_rotation(params, server.basis.bases))
    lam = np.asarray(gaussian_kron.in_bases(server.basis.bases).precision_matrix(server.q.precision))
    want = u @ np.diag(np.diag(u.T @ hessian @ u)) @ u.T  # the Hessian holds the prior's delta = 1, basis-invariant
    np.testing.assert_allclose(lam, want, rtol=2e-2, atol=2e-3 * np.abs(want).max())  # float32 clients
    full = np.diag(np.linalg.inv(hessian))
    kron = np.diag(np.linalg.inv(lam)) / full
    diagonal = (1.0 / np.diag(hessian)) / full
    assert np.median(kron) > 1.5 * np.median(diagonal)
    # the predictive draws from the structure itself: its draws' covariance is q_g's
    from fedbayes.evaluation.evaluators import dense_spread, restrict_to_subset

    spread = dense_spread(server.params, alg.server_precision(server))
    draws = gaussian_kron.sample_spread(jax.random.key(0), spread, 20000)
    flat = jax.vmap(lambda d: ravel_pytree(d)[0])(draws)
    np.testing.assert_allclose(np.cov(np.asarray(flat).T), np.linalg.inv(lam), atol=0.05 * np.abs(np.linalg.inv(lam)).max())
    assert restrict_to_subset(spread, "last_layer").key == "dense"


def test_model_file_and_marglik_keep_the_structure(tmp_path):
    from fedbayes.evaluation import prior_precision
    from fedbayes.runs.export import load_model, save_model

    delta = 1.3
    with jax.enable_x64(True):
        prob = Problem()
        alg = _algorithm(prob.apply_fn, prob.trainer, task="regression", rho=1.0, basis_rounds=1, solver=newton_solver, delta=delta)
        state, _, _ = run_rounds(alg, prob, 12)
        lam = np.asarray(gaussian_kron.in_bases(state.basis.bases).precision_matrix(state.q.precision))
        path = save_model(tmp_path / "model.npz", alg, state)
        with np.load(path) as z:
            assert z["posterior_precision_left/dense/kernel"].shape == (DIM, DIM) and "posterior_precision_left/dense/bias" not in z.files
        saved = load_model(path)["posterior_precision"]
        np.testing.assert_allclose(np.asarray(gaussian_kron.in_bases(saved.bases).precision_matrix(saved.precision)), lam, rtol=1e-12)
        # the marginal likelihood in the structure: the Laplace evidence with log det(G + delta' I) of the dense matrices
        mean = state.params
        curv = prior_precision.curvature(saved, delta)
        g = lam - delta * np.eye(DIM + 1)
        m = ravel_pytree(mean)[0]
        for d2 in (0.1, 1.3, 7.0):
            want = -0.5 * d2 * m @ m + 0.5 * (DIM + 1) * np.log(d2) - 0.5 * np.linalg.slogdet((g + d2 * np.eye(DIM + 1)) / (2 * np.pi))[1]
            want += (DIM + 1) * -0.5 * np.log(2 * np.pi)  # log N's normaliser, as the diagonal objective writes it
            np.testing.assert_allclose(float(prior_precision.log_marginal_likelihood(mean, curv, d2)), want, rtol=1e-6)  # delta' in float32
            moved = prior_precision.with_prior_precision(curv, d2)
            np.testing.assert_allclose(np.asarray(gaussian_kron.in_bases(moved.bases).precision_matrix(moved.precision)), g + d2 * np.eye(DIM + 1), atol=1e-10)


def test_message_holds_the_factors_and_its_size_is_counted():
    with jax.enable_x64(True):
        prob = Problem()
        alg = _algorithm(prob.apply_fn, prob.trainer, task="regression", rho=1.0, basis_rounds=1, solver=newton_solver)
        state = alg.server_init(jax.random.key(0), prob.params)
        message, _, _ = jax.jit(alg.client_update)(jax.random.key(1), alg.broadcast(state), alg.client_init(prob.params), prob.datas[0])
        d = DIM + 1
        factors = message.sketch["dense"]
        assert factors["kernel"].left.shape == (DIM, DIM) and factors["kernel"].right.shape == (1, 1) and factors["bias"].left is None
        numbers = sum(np.size(x) for x in jax.tree.leaves(message.difference)) + sum(np.size(x) for x in jax.tree.leaves(message.sketch))
        assert numbers == 2 * d + gaussian_kron.factor_numbers(prob.params)
        assert numbers * sites.FLOAT32_BYTES == sites.natural_bytes(d, "kron", gaussian_kron.factor_numbers(prob.params))
        # the input factor is the client's X^T X
        x = np.asarray(prob.datas[0].x)
        np.testing.assert_allclose(np.asarray(factors["kernel"].left), x.T @ x, rtol=1e-10)
        assert bool(alg.message_ok(state, message))
        bad = message._replace(sketch=jax.tree.map(lambda a: a.at[0].set(np.nan), message.sketch))
        assert not bool(alg.message_ok(state, bad))


def test_kron_is_a_fedlap_cov_setting():
    cfg = validate({"algorithm": {"name": "fedlap_cov", "covariance": "kron"}})
    assert cfg.algorithm.basis_rounds == 3
    for extra, field in (
        ({"server": {"aggregator": "median"}}, "server.aggregator: fedlap_cov with covariance = 'kron'"),
        ({"privacy": {"clip": 1.0}, "server": {"weighting": "uniform"}}, "privacy.clip: fedlap_cov with covariance = 'kron'"),
    ):
        with pytest.raises(ConfigError, match=field):
            validate({"algorithm": {"name": "fedlap_cov", "covariance": "kron"}, **extra})
    with pytest.raises(ConfigError, match="covariance"):
        validate({"algorithm": {"name": "pvi", "covariance": "kron"}})


def test_a_layer_of_many_inputs_is_refused_before_the_run():
    wide = {"dense": {"kernel": jax.ShapeDtypeStruct((6000, 10), jnp.float32), "bias": jax.ShapeDtypeStruct((10,), jnp.float32)}}
    with pytest.raises(ValueError, match=r"algorithm.covariance: a 'kron' message"):
        sites.check_kron_size(wide)
    sites.check_kron_size({"dense": {"kernel": jax.ShapeDtypeStruct((784, 200), jnp.float32)}})
