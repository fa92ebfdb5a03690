"""Linear Gaussian sites: the building blocks of the Laplace versions of partitioned variational
inference (Swaroop, Khan and Doshi-Velez, "Connecting Federated ADMM to Bayes", ICLR 2025,
Sec. 3.2-3.4), shared by FedLap (:mod:`fedbayes.algorithms.fedlap`), FedLap-Func
(:mod:`fedbayes.algorithms.fedlap_func`) and, for the start of local training and the settings'
check, FedLap-Cov (:mod:`fedbayes.algorithms.fedlap_cov`). docs/algorithms.md §9.

With ``q_g = N(w_g, I / delta)`` and the prior ``p_0 = N(0, I / delta)`` every client site is a
linear factor ``t_k(w) ∝ exp(delta v_k^T w)`` and ``w_g = sum_k v_k``. One round, client ``k``
(``l_k`` its SUM loss):

    w_k <- argmin_w  l_k(w) + delta v_k^T w + (delta / 2) ||w - w_g||^2      (Eq. 9)
    v_k <- v_k + rho (w_k - w_g)

(:func:`client_step`: :func:`client_penalty` and :func:`dual_update`), and the server
``w_g <- w_g + sum of the accepted site changes`` (:func:`server_step`). FedLap-Func adds its
function-space term to the same objective through ``extra``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax

from fedbayes.data.batches import ClientData
from fedbayes.inference.base import LocalSolver
from fedbayes.inference.sgd import LocalTrainer, per_example, run_sgd

__all__ = [
    "Broadcast",
    "ServerState",
    "broadcast",
    "check_settings",
    "client_penalty",
    "client_step",
    "dual_update",
    "server_init",
    "server_step",
    "site_terms",
    "training_start",
]


class ServerState(NamedTuple):
    """FedLap server state.

    Attributes:
      params: the global mean ``w_g = sum_k v_k`` (what is evaluated and exported).
      init: the model's initial parameters, where local training starts in round 1.
      round: rounds done.
    """

    params: optax.Params
    init: optax.Params
    round: jax.Array


class Broadcast(NamedTuple):
    """What every sampled client receives: the anchor ``w_g`` and where local training starts
    (the initial parameters in round 1, ``w_g`` afterwards)."""

    anchor: optax.Params
    start: optax.Params


def check_settings(name: str, delta: float, damping: float) -> None:
    """Raises ``ValueError`` naming the field (the config's ``delta``, ``rho``) unless ``delta > 0``
    and ``0 < damping <= 1``."""
    if not delta > 0:
        raise ValueError(f"{name}: delta must be > 0; got {delta}")
    if not 0 < damping <= 1:
        raise ValueError(f"{name}: rho must be in (0, 1]; got {damping}")


def server_init(params) -> ServerState:
    """``w_g = 0`` (the prior mean; every site starts at 0) and the initial parameters."""
    return ServerState(optax.tree.zeros_like(params), params, jnp.zeros((), jnp.int32))


def training_start(init, params, round_idx: jax.Array):
    """Where local training starts: the initial parameters in round 1, ``w_g`` afterwards."""
    first = round_idx == 0
    return jax.tree.map(lambda i, w: jnp.where(first, i, w), init, params)


def broadcast(state: ServerState) -> Broadcast:
    return Broadcast(state.params, training_start(state.init, state.params, state.round))


def site_terms(w, anchor, site, delta: float) -> jax.Array:
    """``delta v_k^T w + (delta / 2) ||w - w_g||^2``: the site and prior terms of the client
    objective on the sum-loss scale (the KL to the cavity ``q_g / t_k`` up to a constant)."""
    diff = optax.tree.sub(w, anchor)
    return delta * (optax.tree.vdot(site, w) + 0.5 * optax.tree.vdot(diff, diff))


def client_penalty(anchor, site, *, delta: float, num_examples, extra: Callable | None = None) -> Callable:
    """``w -> (site_terms(w) + extra(w)) / n_k``: what the trainer adds to the mean data loss, so
    that it minimises ``(l_k(w) + site_terms(w) + extra(w)) / n_k``.

    ``extra`` is an optional further term on the sum-loss scale (FedLap-Func's function-space
    term); ``None`` adds nothing (not even a zero).
    """

    def penalty(w):
        total = site_terms(w, anchor, site, delta)
        if extra is not None:
            total = total + extra(w)
        return per_example(total, num_examples)

    return penalty


def dual_update(site, w_k, anchor, damping: float):
    """``v_k + rho (w_k - w_g)``, ``rho`` the damping (Eq. 9's dual step on a point site)."""
    return optax.tree.add_scale(site, damping, optax.tree.sub(w_k, anchor))


def client_step(
    key: jax.Array,
    message: Broadcast,
    site,
    data: ClientData,
    trainer: LocalTrainer,
    *,
    delta: float,
    damping: float,
    extra: Callable | None = None,
    solver: LocalSolver = run_sgd,
):
    """One FedLap client round: the local primal solve and the dual update.

    Returns ``(w_k, new_site, site_change, info)``; ``site_change = new_site - site`` is the
    message, ``info`` the solver's training info.
    """
    penalty = client_penalty(message.anchor, site, delta=delta, num_examples=data.num_examples, extra=extra)
    w_k, info = solver(key, message.start, data, trainer, penalty)
    new_site = dual_update(site, w_k, message.anchor, damping)
    return w_k, new_site, optax.tree.sub(new_site, site), info


def server_step(state: ServerState, site_change_total) -> ServerState:
    """``w_g <- w_g + sum of the accepted clients' site changes`` (= ``sum_k v_k``)."""
    return ServerState(optax.tree.add(state.params, site_change_total), state.init, state.round + 1)
