"""FedLap and FedLap-Cov (docs/algorithms.md §9-10) on least-squares clients with exact local
solves, where the target is known in closed form: the MAP of ``sum_k l_k(w) + delta/2 ||w||^2``
with ``l_k(w) = 1/2 ||Z_k w - y_k||^2`` (``Z`` the features with a ones column for the bias) is
``(sum_k Z_k^T Z_k + delta I)^{-1} sum_k Z_k^T y_k``.

The rounds here go through the public round protocol (:func:`fedbayes.round.server_step`) with
every client in the cohort; the local solve is one Newton step on the client's objective (exact
for a quadratic), in float64.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.flatten_util import ravel_pytree

from fedbayes import round as protocol
from fedbayes.algorithms.fedlap import client_penalty, fedlap
from fedbayes.data.batches import ClientData, get_batch
from fedbayes.inference.sgd import LocalTrainer, training_info
from fedbayes.models import init_params, loss_fn, make_model

SIZES = (7, 12, 5, 9)
DIM = 3
BATCH = max(SIZES)


def newton_solver(key, start, data, trainer, penalty):
    """The exact minimiser of ``mean loss + penalty`` for a quadratic: one Newton step."""
    x, y, m = get_batch(data, jnp.zeros((), jnp.int32), trainer.batch_size)
    flat, unravel = ravel_pytree(start)

    def f(z):
        p = unravel(z)
        return trainer.loss_fn(p, key, x, y, m) + penalty(p)

    z = flat - jnp.linalg.solve(jax.hessian(f)(flat), jax.grad(f)(flat))
    return unravel(z), training_info(f(z).astype(jnp.float32), 1)


class Problem:
    """A least-squares federation in float64 (build inside ``jax.enable_x64``)."""

    def __init__(self, seed=0, sizes=SIZES, dim=DIM):
        rng = np.random.default_rng(seed)
        self.model = make_model("linear", 1)
        self.apply_fn = lambda p, x: self.model.apply({"params": p}, x)
        self.trainer = LocalTrainer(loss_fn(self.model, "regression"), optax.sgd(0.1), 1, BATCH)
        params = init_params(self.model, jax.random.key(1), (dim,))
        self.params = jax.tree.map(lambda p: jnp.asarray(p, jnp.float64), params)
        true_w = rng.normal(size=dim)
        self.datas, zs, ys = [], [], []
        for k, n in enumerate(sizes):
            x = rng.normal(loc=0.3 * (k - 1.5), scale=0.5 + 0.2 * k, size=(n, dim)) / np.sqrt(n)  # heterogeneous clients
            y = x @ true_w + 0.3 * k + rng.normal(size=n)
            xp = np.zeros((BATCH, dim)), np.zeros(BATCH)
            xp[0][:n], xp[1][:n] = x, y
            order = np.arange(BATCH, dtype=np.int32)
            self.datas.append(ClientData(jnp.asarray(xp[0]), jnp.asarray(xp[1]), jnp.asarray(order), jnp.int32(0), jnp.int32(n)))
            zs.append(np.concatenate([x, np.ones((n, 1))], axis=1))
            ys.append(y)
        self.z, self.y = zs, ys

    def map(self, delta):
        a = sum(z.T @ z for z in self.z) + delta * np.eye(self.z[0].shape[1])
        return np.linalg.solve(a, sum(z.T @ y for z, y in zip(self.z, self.y)))

    def hessians(self):
        return [z.T @ z for z in self.z]


def flat_params(p) -> np.ndarray:
    """The linear model's parameters as ``[kernel..., bias]`` (the order of ``Z``'s columns)."""
    return np.concatenate([np.asarray(p["dense"]["kernel"]).ravel(), np.asarray(p["dense"]["bias"]).ravel()])


def run_rounds(alg, prob: Problem, rounds: int, on_round=None):
    """``rounds`` full-participation rounds through the round protocol; returns the server state,
    the client states and the server parameters after each round."""
    state = alg.server_init(jax.random.key(0), prob.params)
    cstates = [alg.client_init(prob.params) for _ in prob.datas]
    weights = jnp.asarray([float(d.num_examples) for d in prob.datas])
    update = jax.jit(alg.client_update)
    step = jax.jit(lambda s, m, w: protocol.server_step(alg, s, m, w, jax.random.key(2)))
    history = []
    for r in range(rounds):
        message = alg.broadcast(state)
        outs = [update(jax.random.key(r), message, c, d) for c, d in zip(cstates, prob.datas)]
        msgs = jax.tree.map(lambda *xs: jnp.stack(xs), *[o[0] for o in outs])
        state, accepted, _ = step(state, msgs, weights)
        assert bool(jnp.all(accepted))
        cstates = [o[1] for o in outs]
        history.append(flat_params(alg.server_params(state)))
        if on_round is not None:
            on_round(state, cstates)
    return state, cstates, history


@pytest.mark.parametrize("delta, rho", [(7.0, 0.5), (20.0, 0.25)])
def test_fedlap_converges_to_the_exact_map(delta, rho):
    # (A delta far below the clients' curvature converges too, but slowly: docs/algorithms.md §9.)
    with jax.enable_x64(True):
        prob = Problem()
        alg = fedlap(prob.trainer, delta=delta, rho=rho, solver=newton_solver)
        _, cstates, history = run_rounds(alg, prob, 100)
        target = prob.map(delta)
        errors = [np.max(np.abs(h - target)) for h in history]
        assert errors[-1] < 1e-8 * max(1.0, np.max(np.abs(target)))
        assert errors[-1] < 1e-3 * errors[0]  # it moved there; round 1 is not the answer
        # The sites at the fixed point: v_k = -grad l_k(w_g) / delta.
        for cs, z, y in zip(cstates, prob.z, prob.y):
            np.testing.assert_allclose(flat_params(cs), -(z.T @ (z @ target - y)) / delta, atol=1e-7)


def test_fedlap_single_client_undamped_is_the_map_in_one_round():
    with jax.enable_x64(True):
        prob = Problem(sizes=(11,))
        alg = fedlap(prob.trainer, delta=2.0, rho=1.0, solver=newton_solver)
        _, _, history = run_rounds(alg, prob, 2)
        np.testing.assert_allclose(history[0], prob.map(2.0), rtol=1e-10, atol=1e-12)
        np.testing.assert_allclose(history[1], history[0], rtol=1e-10, atol=1e-12)  # a fixed point


def test_fedlap_round_one_is_the_local_map_under_the_prior():
    # v_k = 0, w_g = 0: each client solves l_k + delta/2 ||w||^2; with rho the server sums rho w_k.
    with jax.enable_x64(True):
        prob = Problem()
        delta, rho = 3.0, 0.25
        alg = fedlap(prob.trainer, delta=delta, rho=rho, solver=newton_solver)
        _, _, history = run_rounds(alg, prob, 1)
        local = [np.linalg.solve(z.T @ z + delta * np.eye(DIM + 1), z.T @ y) for z, y in zip(prob.z, prob.y)]
        np.testing.assert_allclose(history[0], rho * sum(local), rtol=1e-10)


def test_fedlap_round_one_starts_from_the_initial_parameters_then_from_w_g():
    prob_params = {"w": jnp.asarray([1.0, -2.0])}
    trainer = LocalTrainer(lambda p, k, x, y, m: 0.0 * jnp.sum(p["w"]), optax.sgd(0.1), 1, 4)
    alg = fedlap(trainer, delta=1.0, rho=0.5)
    state = alg.server_init(jax.random.key(0), prob_params)
    np.testing.assert_array_equal(alg.server_params(state)["w"], [0.0, 0.0])  # the prior mean
    np.testing.assert_array_equal(alg.broadcast(state).start["w"], [1.0, -2.0])
    state = state._replace(params={"w": jnp.asarray([0.5, 0.5])}, round=jnp.int32(1))
    np.testing.assert_array_equal(alg.broadcast(state).start["w"], [0.5, 0.5])


def test_fedlap_penalty_is_the_site_terms_over_n():
    w, anchor, site = {"a": jnp.asarray([1.0, 2.0])}, {"a": jnp.asarray([0.5, -1.0])}, {"a": jnp.asarray([0.25, 0.5])}
    pen = client_penalty(anchor, site, delta=4.0, num_examples=jnp.int32(8))
    expected = 4.0 * (0.25 * 1.0 + 0.5 * 2.0 + 0.5 * (0.5**2 + 3.0**2)) / 8.0
    np.testing.assert_allclose(pen(w), expected, rtol=1e-6)
    extra = client_penalty(anchor, site, delta=4.0, num_examples=jnp.int32(8), extra=lambda p: jnp.sum(p["a"]))
    np.testing.assert_allclose(extra(w), expected + 3.0 / 8.0, rtol=1e-6)


@pytest.mark.parametrize("delta, rho", [(0.0, 0.1), (-1.0, 0.1), (1.0, 0.0), (1.0, 1.5)])
def test_fedlap_rejects_bad_settings(delta, rho):
    with pytest.raises(ValueError, match="fedlap: (delta|rho)"):
        fedlap(LocalTrainer(None, optax.sgd(0.1), 1, 1), delta=delta, rho=rho)
