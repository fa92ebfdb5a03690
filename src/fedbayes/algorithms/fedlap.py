"""FedLap: the Laplace version of partitioned variational inference with isotropic Gaussians
(Swaroop, Khan and Doshi-Velez, "Connecting Federated ADMM to Bayes", ICLR 2025, Sec. 3.2, Eq. 9).

docs/algorithms.md §9. The global approximation and the prior are isotropic Gaussians of the same
precision ``delta``: ``q_g = N(w_g, I / delta)``, ``p_0 = N(0, I / delta)``. Every client site is then
a linear factor ``t_k(w) ∝ exp(delta v_k^T w)``, so the global mean is the sum of the sites,
``w_g = sum_k v_k``. One round, client ``k``:

    w_k <- argmin_w  l_k(w) + delta v_k^T w + (delta / 2) ||w - w_g||^2      (l_k the SUM loss)
    v_k <- v_k + rho (w_k - w_g)

and the server ``w_g <- sum_k v_k`` (no division by ``K``, no ``rho``, no server optimizer: the
Bayesian server is the product of the sites). The fixed point is the MAP of
``sum_k l_k(w) + (delta / 2) ||w||^2``.

Choices:

* **Loss scale.** ``delta`` is on the scale of the sum loss ``l_k``. The trainer minimises the
  mean loss, so the client minimises ``(l_k(w) + delta v_k^T w + delta/2 ||w - w_g||^2) / n_k``:
  the same minimiser, and the client learning rate keeps its meaning across methods (the paper's
  remark that dividing by ``n_k`` gives the ADMM penalty ``delta / n_k``).
* **No local weight decay**: the prior is already in the prox term.
* **Partial participation.** The server keeps ``w_g = sum_k v_k`` over *all* ``K`` clients. A
  client sends its site's change ``v_k^new - v_k^old = rho (w_k - w_g)``; the server adds the
  unweighted sum over the accepted clients (:attr:`~fedbayes.aggregators.Aggregate.total`), so an
  absent client's site keeps its last value. With full participation this is exactly Eq. 9.
  Client weights act only as a participation mask.
* **Initialisation**: ``v_k = 0`` and ``w_g = 0`` (the prior mean), so
  round 1 is each client's local MAP under the prior. Local training starts from the model's
  initial parameters in round 1 (a network started at zero cannot break its symmetry) and from
  ``w_g`` afterwards; the broadcast therefore carries the anchor ``w_g`` and the start.
* **Damping** ``rho`` defaults to ``1 / K`` (``K`` all clients, as in the paper). ``rho = 1`` with
  ``K > 1`` oscillates or diverges.
* There is no server optimizer: the server's update is exact (a config that sets one is rejected).

Building blocks, public so that FedLap-Func (Swaroop et al. 2025 (ADMM and Bayes) Sec. 3.4) can add its function-space
term to the same client objective and reuse the dual update and the server:
:func:`site_terms`, :func:`client_penalty`, :func:`dual_update`, :func:`client_step`,
:func:`server_step`, :class:`ServerState`, :class:`Broadcast`, :func:`broadcast`; FedLap-Cov
shares :func:`training_start` and :func:`per_example`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal, NamedTuple

import jax
import jax.numpy as jnp
import optax
from pydantic import Field

from fedbayes.algorithms.base import Algorithm, AlgorithmSpec, BuildContext, finite_message
from fedbayes.data.batches import ClientData
from fedbayes.hparams import HParams
from fedbayes.inference.sgd import LocalTrainer, run_sgd

PyTree = Any
# (key, start, data, trainer, penalty) -> (params, info): run_sgd's signature; tests pass exact solvers.
LocalSolver = Callable[..., tuple[PyTree, dict]]

__all__ = [
    "Broadcast",
    "FedLapConfig",
    "LocalSolver",
    "ServerState",
    "broadcast",
    "check_settings",
    "client_penalty",
    "client_step",
    "dual_update",
    "fedlap",
    "per_example",
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


def per_example(total: jax.Array, num_examples) -> jax.Array:
    """``total / n_k`` (``n_k`` at least 1): a sum-loss-scale term on the trainer's mean-loss scale."""
    n = jnp.maximum(jnp.asarray(num_examples), 1)
    return total / n.astype(total.dtype)


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


def fedlap(
    trainer: LocalTrainer,
    *,
    delta: float,
    damping: float,
    solver: LocalSolver = run_sgd,
) -> Algorithm:
    """FedLap (docs/algorithms.md §9) with prior precision ``delta > 0`` (sum-loss scale) and
    damping ``0 < rho <= 1``.

    Args:
      trainer: local training (mean loss, optimizer, epochs, batch size).
      delta: precision of the prior and of ``q_g``.
      damping: site damping ``rho`` (the paper's choice is ``1 / K``).
      solver: the local solver, ``run_sgd`` by default (tests pass an exact one).
    """
    check_settings("fedlap", delta, damping)

    def client_update(key, message: Broadcast, site, data):
        _, new_site, change, info = client_step(key, message, site, data, trainer, delta=delta, damping=damping, solver=solver)
        return change, new_site, info

    def server_update(key, state, aggregate):
        del key
        return server_step(state, aggregate.total), {}

    return Algorithm(
        name="fedlap",
        server_init=lambda key, params: server_init(params),
        broadcast=broadcast,
        client_init=optax.tree.zeros_like,
        client_update=client_update,
        server_update=server_update,
        server_params=lambda state: state.params,
        message_ok=finite_message,
        trainer=trainer,
    )


class FedLapConfig(HParams):
    """FedLap (docs/algorithms.md §9)."""

    name: Literal["fedlap"]
    delta: float = Field(1.0, gt=0, description="prior precision delta, on the sum-loss scale")
    rho: float | None = Field(None, gt=0, le=1, description="site damping rho; default 1 / num_clients")


def build(hp: FedLapConfig, ctx: BuildContext) -> Algorithm:
    return fedlap(ctx.trainer, delta=hp.delta, damping=hp.rho if hp.rho is not None else 1.0 / ctx.federation.num_clients)


SPEC = AlgorithmSpec(
    "fedlap", FedLapConfig, build, "Laplace PVI with isotropic Gaussian sites: ADMM-like duals, w_g = sum of the sites",
    bayesian=True, exact_server="multiplies the clients' sites exactly",
)  # fmt: skip
SPECS = (SPEC,)
