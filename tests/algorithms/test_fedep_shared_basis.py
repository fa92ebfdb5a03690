"""FedEP's laplace method in the structures whose basis the server shares. Kronecker-factored (EKFAC
eigenbases): on a logistic regression its fixed point is the MAP of all the data with the central
Laplace precision in the structure, ``U diag(diag(U^T H U)) U^T`` in the bases it fixed; under
partial participation the server's ``q_g`` stays the prior times the sites, each site of the basis
rounds moved into the bases when its client returns; the model file and the personal posterior
read the structure. Low rank in a shared basis: the fixed point is the MAP with the central
Laplace exact in the basis's span and diagonal outside it, the basis holding the curvature's
leading direction. The config's refusals."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import single_client_data
from jax.flatten_util import ravel_pytree
from test_fedep_full import NUM_CLIENTS, PER_CLIENT, PRIOR, _central_laplace, _problem

from fedbayes import gaussian_kron, gaussian_subspace, protocol
from fedbayes.algorithms.fedep import SharedBasis, fedep_shared_basis
from fedbayes.config.schema import ConfigError, validate
from fedbayes.inference import LocalTrainer
from fedbayes.inference.tilted import TiltedSettings, make_shared_basis_laplace_inference
from fedbayes.models import loss_fn
from fedbayes.runs.export import load_model, save_model
from fedbayes.sim.simulator import Simulator


def _algorithm(model, *, damping=0.5, basis_rounds=3, epochs=50, covariance="kron", rank=0):
    trainer = LocalTrainer(loss_fn(model, "classification"), optax.sgd(0.5), epochs, PER_CLIENT)
    apply = lambda p, x: model.apply({"params": p}, x)  # noqa: E731
    inference = make_shared_basis_laplace_inference(trainer, TiltedSettings(), apply_fn=apply, covariance=covariance)
    return fedep_shared_basis(
        trainer, optax.sgd(1.0), inference, structure=SharedBasis(covariance, basis_rounds, rank), total_examples=NUM_CLIENTS * PER_CLIENT,
        damping=damping, alpha_cov=0.0, prior_precision=PRIOR, exact_late_sites=True,
    )  # fmt: skip


def _run(algo, fed, params, rounds):
    sim = Simulator(algo, fed, clients_per_round=NUM_CLIENTS, seed=0)
    state = sim.init(params)
    for _ in range(rounds):
        state, info = sim.run_round(state)
        assert len(info.rejected) == 0
    return state


def test_the_fixed_point_is_the_central_laplace_in_the_structure(tmp_path):
    fed, model, params = _problem()
    algo = _algorithm(model)
    state = _run(algo, fed, params, 30)
    server = state.server_state
    map_flat, hessian = _central_laplace(model, params, fed.x, fed.y)
    mean, variance = algo.server_posterior(server)
    np.testing.assert_allclose(ravel_pytree(mean)[0], map_flat, atol=1e-4)  # float32 clients
    u = np.asarray(gaussian_kron.dense_rotation(params, server.basis.bases))
    assert np.abs(np.abs(u) - np.eye(len(u))).max() > 0.1  # the bases moved from the identity
    lam = np.asarray(gaussian_kron.in_bases(server.basis.bases).precision_matrix(server.q.precision))
    want = u @ np.diag(np.diag(u.T @ hessian @ u)) @ u.T  # the Hessian holds the prior's PRIOR I, basis-invariant
    np.testing.assert_allclose(lam, want, rtol=2e-3, atol=1e-3 * np.abs(want).max())
    np.testing.assert_allclose(ravel_pytree(variance)[0], np.diag(np.linalg.inv(lam)), rtol=1e-4)
    # closer to the full Laplace's marginal variances than the diagonal Laplace's
    full = np.diag(np.linalg.inv(hessian))
    assert np.median(np.diag(np.linalg.inv(lam)) / full) > 1.2 * np.median((1.0 / np.diag(hessian)) / full)
    # model.npz holds the structure, and reads back as it
    path = save_model(tmp_path / "model.npz", algo, server)
    saved = load_model(path)["posterior_precision"]
    np.testing.assert_allclose(np.asarray(gaussian_kron.in_bases(saved.bases).precision_matrix(saved.precision)), lam, rtol=1e-6)
    # the personal posterior q_g t_k^w in the structure
    site = jax.tree.map(lambda s: s[1], state.client_states)
    mean_k, var_k = algo.personal_posterior(server, site, 0.5)
    lam_k = lam + 0.5 * np.asarray(gaussian_kron.in_bases(server.basis.bases).precision_matrix(site.site.precision))
    eta = ravel_pytree(server.q.precision_mean)[0] + 0.5 * ravel_pytree(site.site.precision_mean)[0]
    np.testing.assert_allclose(ravel_pytree(mean_k)[0], np.linalg.solve(lam_k, eta), rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(ravel_pytree(var_k)[0], np.diag(np.linalg.inv(lam_k)), rtol=1e-4)


def _product_of_sites(server, cstates):
    """``p_0 prod_k t_k`` in the server's bases, a site of the basis rounds moved as its client
    will move it."""
    bases, anchor = server.basis.bases, server.basis.anchor
    total = gaussian_kron.KronGaussian(jax.tree.map(jnp.zeros_like, anchor), jax.tree.map(lambda p: jnp.full_like(p, PRIOR), anchor))
    moved = bool(jnp.any(jnp.asarray([jnp.any(b != jnp.eye(b.shape[0])) for b in jax.tree.leaves(bases)])))
    for c in cstates:
        site = gaussian_kron.move(c.site, bases, anchor) if moved and int(c.fixed) == 0 else c.site
        total = gaussian_kron.product(total, site)
    return total


def test_absent_clients_sites_are_moved_when_they_return():
    fed, model, params = _problem()
    algo = _algorithm(model, basis_rounds=2)
    sim = Simulator(algo, fed, clients_per_round=NUM_CLIENTS, seed=0)
    server = algo.server_init(jax.random.key(0), params)
    cstates = [algo.client_init(params) for _ in range(NUM_CLIENTS)]
    update = jax.jit(algo.client_update)
    step = jax.jit(lambda s, m, w: protocol.server_step(jax.random.key(2), algo, s, m, w))
    # the basis rounds: everyone, then clients 0 and 1; then 0 and 1 for two rounds; then client 2 returns
    for r, cohort in enumerate(((0, 1, 2), (0, 1), (0, 1), (0, 1), (2,))):
        message = algo.broadcast(server)
        outs = {k: update(jax.random.key(r), message, cstates[k], single_client_data(sim, r, k)) for k in cohort}
        msgs = jax.tree.map(lambda *xs: jnp.stack(xs), *[o[0] for o in outs.values()])
        server, accepted, _ = step(server, msgs, jnp.ones((len(cohort),)))
        assert bool(jnp.all(accepted))
        for k, o in outs.items():
            cstates[k] = o[1]
        total = _product_of_sites(server, cstates)
        np.testing.assert_allclose(ravel_pytree(server.q.precision)[0], ravel_pytree(total.precision)[0], rtol=1e-5, atol=1e-4)
        np.testing.assert_allclose(ravel_pytree(server.q.precision_mean)[0], ravel_pytree(total.precision_mean)[0], rtol=1e-5, atol=1e-4)
        if r == 3:
            assert [int(c.fixed) for c in cstates] == [1, 1, 0]  # client 2's site waits in the identity bases
            # without the move the server's product and the sites disagree: the check above can fail
            raw = jax.tree.map(lambda p: jnp.full_like(p, PRIOR), params)
            for c in cstates:
                raw = jax.tree.map(jnp.add, raw, c.site.precision)
            assert np.abs(ravel_pytree(raw)[0] - ravel_pytree(server.q.precision)[0]).max() > 1e-2
    assert [int(c.fixed) for c in cstates] == [1, 1, 1]


def test_low_rank_fixed_point_is_the_central_laplace_in_the_structure():
    fed, model, params = _problem()
    # undamped (delta K = 3 > 2): a part of q_g's core that a cavity dropped would come back -delta K
    # times and grow by |1 - delta K| a round (the core's round-off asymmetry did, before the fix)
    algo = _algorithm(model, covariance="low_rank", rank=4, damping=1.0)
    server = _run(algo, fed, params, 30).server_state
    core = np.asarray(server.q.precision.core)
    assert np.abs(core - core.T).max() < 1e-4 * np.abs(core).max()
    map_flat, hessian = _central_laplace(model, params, fed.x, fed.y)
    mean, variance = algo.server_posterior(server)
    np.testing.assert_allclose(ravel_pytree(mean)[0], map_flat, atol=1e-4)  # float32 clients
    b = np.asarray(server.basis)
    p = b @ b.T
    g = hessian - PRIOR * np.eye(len(hessian))  # the GGN of all the data at the MAP
    rest = (np.eye(len(g)) - p) @ g @ (np.eye(len(g)) - p)
    want = PRIOR * np.eye(len(g)) + np.diag(np.diag(rest)) + p @ g @ p
    lam = np.asarray(gaussian_subspace.in_basis(server.basis).precision_matrix(server.q.precision))
    np.testing.assert_allclose(lam, want, rtol=2e-3, atol=1e-3 * np.abs(want).max())
    np.testing.assert_allclose(ravel_pytree(variance)[0], np.diag(np.linalg.inv(lam)), rtol=1e-4)
    # three power steps from a random start: the basis holds the curvature's leading direction
    top = np.linalg.eigh(hessian)[1][:, -1:]
    assert np.linalg.norm(top - p @ top) < 0.1
    assert np.abs(lam - np.diag(np.diag(lam))).max() > 1.0  # the core is not empty


def test_kron_and_low_rank_are_fedep_laplace_settings():
    cfg = validate({"algorithm": {"name": "fedep", "covariance": "kron"}, "model": {"name": "mlp"}})
    assert cfg.algorithm.covariance == "kron" and cfg.algorithm.basis_rounds == 3
    cfg = validate({"algorithm": {"name": "fedep", "covariance": "low_rank"}, "model": {"name": "mlp"}})
    assert cfg.algorithm.rank == 10 and cfg.algorithm.basis_rounds == 3
    kron = {"name": "fedep", "covariance": "kron"}
    for algorithm, extra, field in (
        ({"name": "fedep", "covariance": "low_rank", "method": "ngvi"}, {}, "algorithm.covariance: 'low_rank' takes the laplace method"),
        ({"name": "fedsep", "covariance": "low_rank"}, {}, "algorithm.covariance: fedsep takes diagonal or full"),
        ({**kron, "method": "ngvi"}, {}, "algorithm.covariance: 'kron' takes the laplace method"),
        ({**kron, "burn_in_rounds": 2}, {}, "set burn_in_rounds = 0"),
        ({"name": "fedsep", "covariance": "kron"}, {}, "algorithm.covariance: fedsep takes diagonal or full"),
        ({**kron, "basis_rounds": 0}, {}, "algorithm.basis_rounds"),
        (kron, {"server": {"aggregator": "median"}}, "server.aggregator: fedep with covariance = 'kron'"),
    ):
        with pytest.raises(ConfigError, match=field) as err:
            validate({"algorithm": algorithm, "model": {"name": "mlp"}, **extra})
        assert "\n" not in str(err.value)
