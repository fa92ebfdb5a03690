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

The building blocks (:func:`~fedbayes.algorithms.laplace_sites.client_step`,
:func:`~fedbayes.algorithms.laplace_sites.server_step`, the states and the broadcast) live in
:mod:`fedbayes.algorithms.laplace_sites`, shared with FedLap-Func and FedLap-Cov; this module
composes them and re-exports them.
"""

from __future__ import annotations

from typing import Literal

import optax
from pydantic import Field

from fedbayes.algorithms.base import Algorithm, AlgorithmSpec, BuildContext, NoInfo, finite_message
from fedbayes.algorithms.laplace_sites import (
    Broadcast,
    ServerState,
    broadcast,
    check_settings,
    client_penalty,
    client_step,
    dual_update,
    server_init,
    server_step,
    site_terms,
    training_start,
)
from fedbayes.hparams import HParams
from fedbayes.inference.base import LocalSolver
from fedbayes.inference.sgd import LocalTrainer, per_example, run_sgd

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
        return server_step(state, aggregate.total), NoInfo()

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
