"""Least-squares clients with exact local solves, shared by the FedLap and FedLap-Cov tests.

The MAP of ``sum_k l_k(w) + delta/2 ||w||^2`` with ``l_k(w) = 1/2 ||Z_k w - y_k||^2`` (``Z`` the
features with a ones column for the bias) is ``(sum_k Z_k^T Z_k + delta I)^{-1} sum_k Z_k^T y_k``;
the local solve is one Newton step on the client's objective (exact for a quadratic), in float64.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.flatten_util import ravel_pytree

from fedbayes import protocol
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
    step = jax.jit(lambda s, m, w: protocol.server_step(jax.random.key(2), alg, s, m, w))
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
